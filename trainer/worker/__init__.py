"""The worker side: what runs in each training process: the process group, data, models, the
optimizer, the training loop, checkpoints, and a worker's own faults and signals."""
