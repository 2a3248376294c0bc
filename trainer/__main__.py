"""``python -m trainer``: what torchrun, Docker, TorchX, Kubernetes and Slurm all run."""

from trainer.cli import entry

entry()
