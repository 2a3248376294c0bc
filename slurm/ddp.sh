#!/usr/bin/env bash
# Multi-node DDP: one task per node, torchrun in it with one process per GPU, c10d rendezvous.
# Submit from the repository root; arguments are trainer overrides:
#   sbatch slurm/ddp.sh
#   sbatch --nodes=4 --gpus-per-node=4 slurm/ddp.sh train.epochs=60
#   RUN_NAME=seed CONFIG=configs/seed.yaml sbatch slurm/ddp.sh train.batch_size=1024
#   CONTAINER_IMAGE=ghcr.io/you/cluster-trainer:0.1.0 sbatch slurm/ddp.sh     # pyxis
#   MIN_NODES=3 sbatch --no-kill --nodes=4 slurm/ddp.sh train.batch_size=576    # elastic: goes on with 3
# Environment knobs are listed in slurm/steps.sh. USR1 arrives 120 s before the time limit: the
# job checkpoints and requeues itself, and the next run resumes from $CKPT_ROOT/$RUN_NAME.
#SBATCH --job-name=cifar-ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --mem=0
# (--mem=0: all of each node's memory, as the data set, pinned buffers and page cache want)
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

# shellcheck source=slurm/steps.sh
source "${REPO:-$SLURM_SUBMIT_DIR}/slurm/steps.sh"
