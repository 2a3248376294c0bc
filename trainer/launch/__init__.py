"""The launcher side: the command line, `trainer torchrun` and its supervisor (the exit contract,
hangs, a lost rendezvous), Slurm, TorchX's components. It starts workers and watches them; no
worker module imports it (tests/scorecard.py counts such arrows: none)."""
