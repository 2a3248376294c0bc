#!/usr/bin/env bash
# One GPU (train.strategy=single), under torchrun for its restarts. Submit from the repository root:
#   sbatch slurm/single.sh
#   RUN_NAME=fast CONFIG=configs/fast.yaml sbatch slurm/single.sh data.name=imagefolder
# Environment knobs are listed in slurm/steps.sh; preemption and requeue work as in slurm/ddp.sh.
# Memory: 4 GiB a CPU (32 GiB for the 8), not the whole node's (--mem=0) that one GPU of a shared
# node does not need; the data set and its loader need far less.
#SBATCH --job-name=cifar-single
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --mem-per-cpu=4G
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

export NPROC_PER_NODE=1
set -- train.strategy=single "$@"
# shellcheck source=slurm/steps.sh
source "${REPO:-$SLURM_SUBMIT_DIR}/slurm/steps.sh"
