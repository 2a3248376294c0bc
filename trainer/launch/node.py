"""This node, as the launcher sets it up for its workers: the GPUs it sees, a HOME it can write, the
caches a restart on a fresh node would otherwise lack, and torchrun's processes per node.

Nothing here imports torch: usage errors and ``--help`` stay fast.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path

from trainer.config import Config
from trainer.launch.torchrun_args import option


def gpu_count() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies), asked of the driver itself:
    torch.cuda.device_count() would cost a torch import (seconds) in a launcher that needs none.
    0 without a driver or a GPU."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:  # CUDA_SUCCESS is 0
        return 0
    return count.value


def writable_home() -> None:
    """Point HOME at a private folder under the temp dir when it is missing or not writable.

    A uid with no passwd entry (a compose ``user:`` override, OpenShift's random uid, Pod Security
    with another ``runAsUser``) often gets HOME=/ : matplotlib then warns on every rank and makes a
    new cache each time, and compile caches have nowhere to live. Children inherit the fix."""
    home = os.environ.get("HOME", "")
    if home and os.path.isdir(home) and os.access(home, os.W_OK | os.X_OK):
        return
    fallback = Path(tempfile.gettempdir()) / f"trainer-home-{os.getuid()}"
    fallback.mkdir(mode=0o700, exist_ok=True)
    os.environ["HOME"] = str(fallback)


BYTECODE = "compile-cache/python-bytecode"
CUDA_JIT = "compile-cache/cuda-jit"


def node_cache_env(cfg: Config | None, probe: str = "torch") -> dict[str, str]:
    """Caches that live on a node, kept on the volume beside the compile caches
    (model.compile_cache) so that a restart on a fresh node finds them; a variable the caller set
    is left alone.

    - CUDA_CACHE_PATH (``compile-cache/cuda-jit``): the driver's cache of kernels it compiled from
      PTX at run time, in ``~/.nv`` otherwise, which a fresh node lacks: its first forward-backward
      compiles them again.
    - PYTHONPYCACHEPREFIX (``compile-cache/python-bytecode``), only where the installation carries
      no bytecode for torch (an image built with ``pip --no-compile`` whose site-packages the job
      cannot write, PYTHONDONTWRITEBYTECODE=1): every process of every start compiles torch's
      Python sources again otherwise.

    What each saves: BENCHMARKS.md, "What each optimisation bought" and the restarts."""
    import importlib.util

    if cfg is None or not cfg.model.compile_cache:
        return {}
    root = cfg.checkpoint.root.resolve()
    env = {} if os.environ.get("CUDA_CACHE_PATH") else {"CUDA_CACHE_PATH": str(root / CUDA_JIT)}
    spec = importlib.util.find_spec(probe)
    bytecode = spec is None or not spec.origin or os.path.exists(importlib.util.cache_from_source(spec.origin))
    if not (bytecode or os.environ.get("PYTHONPYCACHEPREFIX")):
        env["PYTHONPYCACHEPREFIX"] = str(root / BYTECODE)
    return env


def processes_per_node(argv: list[str]) -> int:
    """torchrun's --nproc-per-node as a number (gpu and auto count this node's GPUs, as torchrun does)."""
    value = option(argv, "nproc-per-node", "1")
    if value.isdigit():
        return int(value)
    gpus = gpu_count()
    return gpus if value == "gpu" or (value == "auto" and gpus) else os.cpu_count() or 1
