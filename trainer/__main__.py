"""``python -m trainer``: what torchrun, Docker, TorchX, Kubernetes and Slurm all run."""

import os
import time

# The clock a user feels starts here, before any import: the first step's record reports the seconds
# since the command (TRAINER_COMMAND_START, kept when a launcher further out set it: slurm/launch.sh).
os.environ.setdefault("TRAINER_COMMAND_START", repr(time.time()))

from trainer.cli import entry  # noqa: E402

entry()
