"""A CIFAR-10 trainer for CPUs, one GPU, DataParallel, DDP and many nodes, launched the same way
everywhere. See trainer/cli.py for the launch commands."""

__version__ = "0.1.0"
