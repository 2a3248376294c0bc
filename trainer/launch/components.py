"""TorchX components: typed functions that return an AppDef, each role built here from torchx's
own pieces (``dist.parse_nnodes``, ``specs.resource``, ``specs.parse_mounts``, the rank-0 and app-id
macros), as ``torchx.components.dist.ddp`` builds its own, with our command in it.

From the repository root (scheduler defaults live in .torchxconfig)::

    torchx run --workspace "" -s kubernetes trainer/launch/components.py:train_ddp --image
    ghcr.io/you/cluster-trainer:0.1.0 \\
        --j 2x8 --checkpoint_mount cifar-checkpoints --data_mount cifar-data -- train.epochs=30
    torchx run --workspace "" -s kubernetes trainer/launch/components.py:train_single --image
    ghcr.io/you/cluster-trainer:0.1.0
    SRUN_CPUS_PER_TASK=8 torchx run --workspace "" -s slurm -cfg time=04:00:00 trainer/launch/components.py:train_ddp
    --j 2x8 \\
        --cpu 8 --max_retries 0 --checkpoint_mount "" --checkpoint_dir /shared/ckpt/cifar --data_dir /shared/data
    torchx run --workspace "" -s local_cwd trainer/launch/components.py:train_ddp --j 1x2 --gpu 0 --config
    configs/smoke.yaml \\
        --checkpoint_mount "" --checkpoint_dir ./checkpoints/torchx --data_dir ./data

Every component runs the same command as the other launchers: ``trainer torchrun ... -m trainer train``
(torchrun under the trainer's supervisor, which keeps the exit status contract and, on Slurm, stops
before the time limit and requeues the job after the save: trainer/launch/slurm.py).
"""

# torchx 0.7's component linter reads annotations as written: keep typing.Optional/Dict here.
import os
import shlex
import sys
from typing import Dict, List, Optional

import torchx.specs as specs
from torchx.components.dist import parse_nnodes
from torchx.specs import macros

DEFAULT_IMAGE = "ghcr.io/cluster-trainer/cluster-trainer:0.1.0"
RDZV_PORT = 29500
MOUNTS_ENV = "TRAINER_MOUNTS"
"""trainer.contract.MOUNTS_ENV, written out: torchx runs this file's text in its own module's globals,
from a venv that may not hold the trainer, so nothing here imports it (test_launchers checks they agree).
The dst=volume pairs the job expects mounted: the supervisor stops in one line where a scheduler
dropped them."""


def _mounts(checkpoint_mount: str, checkpoint_root: str, data_mount: str, data_dir: str, mount_type: str) -> List[str]:
    """torchx mount specs: a volume (Kubernetes PVC) or a bind (host path) for checkpoints and data.
    The data volume is writable: the first job to find it empty downloads or decodes the data set
    into it (under a file lock; the others wait), so nothing else needs to fill it."""
    mounts = []
    if checkpoint_mount:
        mounts += ["type=" + mount_type, f"src={checkpoint_mount}", f"dst={checkpoint_root}"]
    if data_mount:
        mounts += ["type=" + mount_type, f"src={data_mount}", f"dst={data_dir}"]
    return mounts


def _pythons() -> List[str]:
    """Interpreters for the job to try, first to last; it takes the first that has torch and the
    trainer (tried where the job runs: a local job on this machine, a remote one in its image or on
    its node), else stops in one line (:data:`NO_PYTHON`). First the one running ``torchx run`` when
    it has torch (by a path relative to the working directory where it lies inside it, as
    ``.venv/bin/torchx`` does: no path of this machine in a remote job otherwise needs it), then
    the repository's ``.venv`` (TorchX from the small `make tools` venv), then ``python3`` and
    ``python`` on the PATH (an image's own; Debian and Ubuntu have no ``python``)."""
    import importlib.util

    here = os.path.abspath(os.getcwd())
    exe = os.path.abspath(sys.executable)
    found = []
    if importlib.util.find_spec("torch") is not None:
        found.append(os.path.relpath(exe, here) if exe.startswith(here + os.sep) else exe)
    venv = os.path.join(".venv", "bin", "python")
    return [*found, *[venv] * (venv not in found), "python3", "python"]


NO_PYTHON = (
    "error: no Python here has torch and the trainer (tried: {tried}): run make venv in the repository (its .venv), "
    "or pip install -e . into a Python that has torch, or set TRAINER_PYTHON=/path/to/python"
)
HAS_TRAINER = "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('trainer')))"


def _command(endpoint: str, torchrun: List[str]) -> str:
    """The replica's shell command: ``trainer torchrun`` under the first interpreter with torch and
    the trainer (a spec lookup: no import, no cost), else one line and exit 2."""
    pythons = " ".join(shlex.quote(p) for p in _pythons())
    return (
        f"for py in ${{TRAINER_PYTHON:-}} {pythons}; do "
        f'command -v "$py" >/dev/null && "$py" -c "{HAS_TRAINER}" 2>/dev/null && '
        f'exec "$py" -m trainer torchrun --rdzv-endpoint "{endpoint}" {" ".join(shlex.quote(a) for a in torchrun)}; '
        f'done; echo "{NO_PYTHON.format(tried="${TRAINER_PYTHON:-} " + pythons)}" >&2; exit 2'
    )


def _role(
    train_args: List[str],
    image: str,
    j: str,
    gpu: int,
    cpu: int,
    memMB: int,
    h: Optional[str],
    mounts: List[str],
    max_restarts: int,
    max_retries: int,
    env: Dict[str, str],
    rdzv_endpoint: str = "",
) -> specs.Role:
    """One role, one replica per node, each running ``trainer torchrun`` with c10d rendezvous on
    the first replica (torchx's rank-0 host macro), or etcd-v2 at ``rdzv_endpoint``, the app id as
    rendezvous id."""
    min_nnodes, max_nnodes, nproc_per_node, nnodes = parse_nnodes(j)
    # multi-node: the rank-0 host as each scheduler exposes it (escaped $ for torchx's templating);
    # on Slurm a port of the job's own (two jobs may share a node, and its nodes agree on it without
    # a word: 20000 + the job id mod 20000), elsewhere RDZV_PORT, the pod's own
    port = f"$$((20000 + $${{SLURM_JOB_ID:-{RDZV_PORT - 20000}}} % 20000))"
    endpoint = "localhost:0" if max_nnodes == 1 else f"$${{{macros.rank0_env}:=localhost}}:{port}"
    backend = "etcd-v2" if rdzv_endpoint else "c10d"
    endpoint = rdzv_endpoint or endpoint
    group = ["--rdzv-backend", backend, "--rdzv-id", macros.app_id, "--nnodes", nnodes]
    torchrun = [*group, "--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts)]
    torchrun += ["-m", "trainer", "train", *train_args]
    return specs.Role(
        name="trainer",
        image=image,
        entrypoint="bash",
        args=["-c", _command(endpoint, torchrun)],
        min_replicas=min_nnodes,
        num_replicas=max_nnodes,
        resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
        env=env,
        port_map={"c10d": RDZV_PORT},
        max_retries=max_retries,
        mounts=specs.parse_mounts(mounts) if mounts else [],
    )


def _sized(j: str, gpu: int, memMB: int) -> tuple[int, int]:
    """GPUs and memory per node where the caller left them at -1: one GPU per process, as the DDP
    ranks need (a CPU job must say gpu=0), and 8 GiB per GPU (an 8-GPU node is not given the memory of one)."""
    nproc = j.rsplit("x", 1)[-1]
    procs = int(nproc) if nproc.isdigit() else 1
    gpu = procs if gpu < 0 else gpu
    return gpu, 8192 * max(gpu, procs) if memMB < 0 else memMB


def train_ddp(
    *script_args: str,
    image: str = DEFAULT_IMAGE,
    j: str = "1x2",
    gpu: int = -1,
    cpu: int = 8,
    memMB: int = -1,
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
    rdzv_endpoint: str = "",
) -> specs.AppDef:
    """DDP training of the CIFAR-10 trainer on ``j`` = NODESxPROCS (one process per GPU).

    Args:
        script_args: trainer overrides, ``key=value`` (after ``--``)
        image: container image with the trainer installed (the repository's Dockerfile, pushed
            to your registry: docs/launchers.md, Publish your image)
        j: {nnodes}x{nproc_per_node}, e.g. 2x8; nproc_per_node must not exceed the GPUs per node.
            Elastic: {min}:{max}x{nproc_per_node}, e.g. 2:4x8: torchrun forms the group with min to
            max nodes (TorchX 0.7's schedulers restart the whole job when a node fails, so a
            restarted job may start with min); every size in the range must split
            train.batch_size (the job refuses it at launch, exit 2)
        gpu: GPUs per node: -1 (the default) asks one per process of ``j`` (2x8: 8), 0 makes a CPU job
            with gloo
        cpu: CPUs per node
        memMB: memory per node in MB: -1 (the default) asks 8 GiB per GPU (per process on the CPU),
            as the Kubernetes manifests do
        h: a registered named resource (takes precedence over cpu, gpu and memMB)
        config: trainer config file inside the image (configs/*.yaml)
        checkpoint_dir: where rank 0 writes checkpoints; keep it stable so a relaunch resumes
        checkpoint_mount: volume for checkpoints: a ReadWriteMany PVC name (mount_type=volume; the
            default is the one `make k8s-storage` creates, so checkpoints outlive the pods) or a host
            path (mount_type=bind), mounted at checkpoint_dir's parent; "" for none. Slurm and
            local schedulers take no mounts: pass "" and a checkpoint_dir on shared storage there
            (the job stops in one line, exit 2, if the mount it expects is missing)
        data_dir: data folder inside the job
        data_mount: volume for the data set, mounted at data_dir; the first job fills it; empty
            for no mount
        mount_type: volume (Kubernetes PVC) or bind (host path)
        max_restarts: torchrun restarts of the process group after a failure (resumes from checkpoint)
        max_retries: scheduler retries of the whole job after a crash. On Slurm the job requeues
            itself after a save for its time limit or a preemption whatever this says, and bad
            input makes it not requeueable; pass 0 there to leave crashes to torchrun's restarts
        env: extra environment variables. TORCH_HOME (the pretrained weights' cache, model.weights)
            defaults to .torch beside the run folder, on the checkpoint volume or shared storage
        rdzv_endpoint: HOST:PORT of an etcd server (v2 API) outside the job: torchrun's etcd-v2
            rendezvous, which outlives any node, the rank-0 host included (the image needs
            python-etcd: the etcd extra). Empty: c10d on the rank-0 host
    """
    gpu, memMB = _sized(j, gpu, memMB)
    checkpoint_root = checkpoint_dir.rstrip("/").rsplit("/", 1)[0] or "/"
    mounts = _mounts(checkpoint_mount, checkpoint_root, data_mount, data_dir, mount_type)
    expected = [
        f"{root}={volume}" for root, volume in ((checkpoint_root, checkpoint_mount), (data_dir, data_mount)) if volume
    ]
    train_args = ["--config", config, f"checkpoint.dir={checkpoint_dir}", f"data.dir={data_dir}", *script_args]
    # on Slurm the supervisor does what TorchX's batch script does not: stop before the time limit,
    # requeue after the save, never after bad input (trainer/launch/slurm.py); elsewhere the variable is inert
    role_env = {
        "PYTHONUNBUFFERED": "1",
        "TRAINER_NO_GPU_FIX": "pass --gpu 0 to the component to train on the CPU",
        "TRAINER_SLURM_SUPERVISE": "1",
        MOUNTS_ENV: ";".join(expected),
        "TORCH_HOME": f"{checkpoint_root.rstrip('/')}/.torch",
        **(env or {}),
    }
    role = _role(train_args, image, j, gpu, cpu, memMB, h, mounts, max_restarts, max_retries, role_env, rdzv_endpoint)
    return specs.AppDef(name="cifar", roles=[role])


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
        data_mount: volume for the data set (the first job fills it)
        mount_type: volume (Kubernetes PVC) or bind (host path)
        max_retries: scheduler retries of the job
    """
    strategy = "train.strategy=single" if gpu else "train.strategy=cpu"
    return train_ddp(
        strategy,
        *script_args,
        image=image,
        j="1x1",
        gpu=gpu,
        cpu=cpu,
        memMB=memMB,
        config=config,
        checkpoint_dir=checkpoint_dir,
        checkpoint_mount=checkpoint_mount,
        data_dir=data_dir,
        data_mount=data_mount,
        mount_type=mount_type,
        max_retries=max_retries,
    )
