"""``python -m trainer``: what torchrun, Docker, TorchX, Kubernetes and Slurm all run."""

from trainer.contract import stamp_command_start  # the standard library only: the clock a user feels starts here

stamp_command_start()

from trainer.cli import entry  # noqa: E402

entry()
