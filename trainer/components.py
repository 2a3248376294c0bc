"""TorchX components: typed functions that return an AppDef, built on ``torchx.components.dist.ddp``.

From the repository root (scheduler defaults live in .torchxconfig)::

    torchx run -s kubernetes trainer/components.py:train_ddp --image ghcr.io/you/cluster-trainer:0.1.0 \\
        --j 2x8 --gpu 8 --checkpoint_mount cifar-checkpoints --data_mount cifar-data -- train.epochs=30
    torchx run -s kubernetes trainer/components.py:train_single --image ghcr.io/you/cluster-trainer:0.1.0
    torchx run -s slurm trainer/components.py:train_ddp --j 2x8 --gpu 8 --checkpoint_dir /shared/ckpt/cifar
    torchx run -s local_cwd trainer/components.py:train_ddp --j 1x2 --gpu 0 --config configs/smoke.yaml \\
        --checkpoint_dir ./checkpoints/torchx

Every component runs the same command as the other launchers: ``trainer torchrun ... -m trainer train``
(torchrun under the trainer's supervisor, which keeps the exit status contract).
"""

# torchx 0.7's component linter reads annotations as written: keep typing.Optional/Dict here.
import sys
from typing import Dict, List, Optional

import torchx.specs as specs
from torchx.components import dist

DEFAULT_IMAGE = "ghcr.io/cluster-trainer/cluster-trainer:0.1.0"


def _mounts(checkpoint_mount: str, checkpoint_dir: str, data_mount: str, data_dir: str, mount_type: str) -> List[str]:
    """torchx mount specs: a volume (Kubernetes PVC) or a bind (host path) for checkpoints and data."""
    mounts = []
    if checkpoint_mount:
        mounts += ["type=" + mount_type, f"src={checkpoint_mount}", f"dst={checkpoint_dir.rsplit('/', 1)[0] or '/'}"]
    if data_mount:
        mounts += ["type=" + mount_type, f"src={data_mount}", f"dst={data_dir}", "readonly"]
    return mounts


def train_ddp(
    *script_args: str,
    image: str = DEFAULT_IMAGE,
    j: str = "1x2",
    gpu: int = -1,
    cpu: int = 8,
    memMB: int = 32768,
    h: Optional[str] = None,
    config: str = "configs/default.yaml",
    checkpoint_dir: str = "/checkpoints/cifar",
    checkpoint_mount: str = "cifar-checkpoints",
    data_dir: str = "/data",
    data_mount: str = "",
    mount_type: str = "volume",
    max_restarts: int = 3,
    max_retries: int = 3,
    env: Optional[Dict[str, str]] = None,
) -> specs.AppDef:
    """DDP training of the CIFAR-10 trainer on ``j`` = NODESxPROCS (one process per GPU).

    Args:
        script_args: trainer overrides, ``key=value`` (after ``--``)
        image: container image with the trainer installed (the repository's Dockerfile)
        j: {nnodes}x{nproc_per_node}, e.g. 2x8; nproc_per_node must not exceed the GPUs per node
        gpu: GPUs per node: -1 (the default) asks one per process of ``j`` (2x8: 8), 0 makes a CPU job
            with gloo
        cpu: CPUs per node
        memMB: memory per node in MB
        h: a registered named resource (takes precedence over cpu, gpu and memMB)
        config: trainer config file inside the image (configs/*.yaml)
        checkpoint_dir: where rank 0 writes checkpoints; keep it stable so a relaunch resumes
        checkpoint_mount: volume for checkpoints: a ReadWriteMany PVC name (mount_type=volume; the
            default is the one `make k8s-storage` creates, so checkpoints outlive the pods) or a host
            path (mount_type=bind), mounted at checkpoint_dir's parent; "" for none (then they die
            with the pod). Slurm and local schedulers take no mounts: checkpoint_dir is a path there
        data_dir: data folder inside the job
        data_mount: volume holding the data set, mounted read-only at data_dir; empty for no mount
        mount_type: volume (Kubernetes PVC) or bind (host path)
        max_restarts: torchrun restarts of the process group after a failure (resumes from checkpoint)
        max_retries: scheduler retries of the whole job
        env: extra environment variables
    """
    if gpu < 0:  # one GPU per process, as the DDP ranks need; a CPU job must say gpu=0
        gpu = int(j.rsplit("x", 1)[-1])
    args = ["train", "--config", config, f"checkpoint.dir={checkpoint_dir}", f"data.dir={data_dir}", *script_args]
    mounts = _mounts(checkpoint_mount, checkpoint_dir, data_mount, data_dir, mount_type)
    app = dist.ddp(
        *args, m="trainer", image=image, name="cifar", j=j, gpu=gpu, cpu=cpu, memMB=memMB, h=h,
        env={"PYTHONUNBUFFERED": "1", **(env or {})}, max_retries=max_retries, mounts=mounts or None,
    )
    role = app.roles[0]
    # `trainer torchrun`: torchrun that keeps the exit contract (0, 75 saved on a signal, 2 bad input).
    # Its interpreter: the one running `torchx run` where that path exists where the job runs
    # (local_cwd, Slurm on a shared file system: `.venv/bin/torchx` works without activating the
    # venv), else the image's `python`.
    role.env.setdefault("TRAINER_PYTHON", sys.executable)
    launcher = 'py="${TRAINER_PYTHON:-python}"; [ -x "$py" ] || py=python; "$py" -m trainer torchrun'
    role.args[-1] = role.args[-1].replace("torchrun ", f"{launcher} --max-restarts {max_restarts} ", 1)
    return app


def train_single(
    *script_args: str,
    image: str = DEFAULT_IMAGE,
    gpu: int = 1,
    cpu: int = 8,
    memMB: int = 32768,
    config: str = "configs/default.yaml",
    checkpoint_dir: str = "/checkpoints/cifar-single",
    checkpoint_mount: str = "cifar-checkpoints",
    data_dir: str = "/data",
    data_mount: str = "",
    mount_type: str = "volume",
    max_retries: int = 3,
) -> specs.AppDef:
    """One-GPU training (train.strategy=single) of the CIFAR-10 trainer.

    Args:
        script_args: trainer overrides, ``key=value`` (after ``--``)
        image: container image with the trainer installed
        gpu: GPUs for the job (1; 0 trains on the CPU)
        cpu: CPUs
        memMB: memory in MB
        config: trainer config file inside the image
        checkpoint_dir: where checkpoints go; keep it stable so a relaunch resumes
        checkpoint_mount: PVC name or host path for checkpoints (cifar-checkpoints; see train_ddp)
        data_dir: data folder inside the job
        data_mount: volume holding the data set, mounted read-only
        mount_type: volume (Kubernetes PVC) or bind (host path)
        max_retries: scheduler retries of the job
    """
    strategy = "train.strategy=single" if gpu else "train.strategy=cpu"
    return train_ddp(
        strategy, *script_args, image=image, j="1x1", gpu=gpu, cpu=cpu, memMB=memMB, config=config,
        checkpoint_dir=checkpoint_dir, checkpoint_mount=checkpoint_mount, data_dir=data_dir, data_mount=data_mount,
        mount_type=mount_type, max_retries=max_retries,
    )
