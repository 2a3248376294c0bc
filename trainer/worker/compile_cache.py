"""Compiled artifacts kept on the checkpoint volume, so that a restart skips most of torch.compile.

A cluster job starts many times (first launch, every preemption, every crash restart), often on a
fresh node whose local caches are empty. With ``model.compile_cache=true`` every rank points
torch's own compile caches at ``<checkpoint.dir>/compile-cache/<key>/`` before anything compiles:
``inductor/`` (TORCHINDUCTOR_CACHE_DIR: compiled graphs, AOTAutograd entries, autotuning results,
generated code and, on the CPU, the built C++ kernels) and ``triton/`` (TRITON_CACHE_DIR: the GPU
kernels' binaries). torch writes each entry atomically; a restart on any node reads them back
instead of compiling. (The alternative, ``torch.compiler.save_cache_artifacts``, measured little:
its blob leaves the kernels to be built again on a fresh node.)

The key hashes what decides what gets compiled: the torch, CUDA and Python versions, the device
(GPU name or CPU), the world size and strategy, the resolved fast path, and the config sections the
compiled step depends on; a folder of another key is never read. After each warm-up rank 0 seals
the folder: ``MANIFEST.json`` lists every file with its size and sha256. Before the next start
compiles, rank 0 checks them; a folder with a changed or missing file, or without a manifest (a
start that died while compiling), is set aside with a warning and the run compiles from scratch.
The newest ``KEEP`` keys stay.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.contract import warn
from trainer.files import replacing, sha256

FOLDER = "compile-cache"
KEEP = 4
MANIFEST = "MANIFEST.json"


def key(cfg: Any, rt: Any, fast: Any) -> str:
    """16 hex digits naming the folder for this torch, device, world and config."""
    device = torch.cuda.get_device_name(rt.device) if rt.cuda else f"cpu-{platform.machine()}"
    parts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": device,
        "world_size": rt.world_size,
        "strategy": rt.strategy,
        "fast": dataclasses.asdict(fast),
        "model": dataclasses.asdict(cfg.model),
        "dist": dataclasses.asdict(cfg.dist),
        "optim": dataclasses.asdict(cfg.optim),
        "train": {
            k: getattr(cfg.train, k) for k in ("batch_size", "precision", "param_dtype", "deterministic", "strategy")
        },
        "data": {k: getattr(cfg.data, k) for k in ("crop_padding", "crop_mode", "flip", "flip_mode")},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def folder(root: Path, name: str) -> Path:
    return root / FOLDER / name


def use(root: Path, name: str) -> Path:
    """Every rank, before anything compiles: torch's inductor and Triton caches live in this key's
    folder (it overrides TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR: the point is to share them)."""
    d = folder(root, name)
    (d / "inductor").mkdir(parents=True, exist_ok=True)
    (d / "triton").mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str((d / "inductor").resolve())
    os.environ["TRITON_CACHE_DIR"] = str((d / "triton").resolve())
    return d


def _files(d: Path) -> list[Path]:
    """The cache's entries: no lock files, no half-written temporaries."""
    return sorted(
        p
        for p in d.rglob("*")
        if p.is_file()
        and p.name != MANIFEST
        and not p.name.endswith(".lock")
        and ".tmp" not in p.name
        and not p.name.startswith("tmp")
    )


def check(root: Path, name: str) -> str:
    """Rank 0, before the others use the folder: 'warm (N files)', 'none', or 'damaged' (the folder
    set aside with a warning)."""
    d = folder(root, name)
    if not d.is_dir() or not any(d.rglob("*")):
        return "none"
    problem = None
    try:
        entries = json.loads((d / MANIFEST).read_text())["files"]
        for rel, (size, digest) in entries.items():
            path = d / rel
            if not path.is_file() or path.stat().st_size != size or sha256(path) != digest:
                problem = f"{rel} is missing or changed"
                break
    except FileNotFoundError:
        problem = f"no {MANIFEST}: the start that wrote it stopped while compiling"
    except (ValueError, KeyError, TypeError) as e:
        problem = f"unreadable {MANIFEST} ({e.__class__.__name__})"
    if problem is None:
        return f"warm ({len(entries)} files)"
    warn(f"ignoring the damaged compile cache {d} ({problem}); compiling from scratch")
    aside = d.with_name(f"{name}.damaged-{os.getpid()}")
    os.replace(d, aside)
    shutil.rmtree(aside, ignore_errors=True)
    return "damaged"


def seal(root: Path, name: str) -> int:
    """Rank 0, after the warm-up compiled the step: write the manifest (atomically), keep the newest
    KEEP keys. Returns the cache's bytes; a failure is only a warning (the next start compiles)."""
    d = folder(root, name)
    try:
        files = _files(d)
        entries = {str(p.relative_to(d)): (p.stat().st_size, sha256(p)) for p in files}
        with replacing(d / MANIFEST) as tmp:
            tmp.write_text(json.dumps({"key": name, "torch": torch.__version__, "files": entries}, indent=0))
    except OSError as e:
        warn(f"could not seal the compile cache {d} ({e.__class__.__name__}: {e}); the next start compiles again")
        return 0
    sealed = [p.parent for p in (root / FOLDER).glob(f"*/{MANIFEST}")]
    for old in sorted(sealed, key=lambda p: (p / MANIFEST).stat().st_mtime, reverse=True)[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
    return sum(size for size, _ in entries.values())
