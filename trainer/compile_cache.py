"""Compiled artifacts kept on the checkpoint volume, so that a restart skips most of torch.compile.

A cluster job starts many times (first launch, every preemption, every crash restart), often on a
fresh node whose local inductor and Triton caches are empty. After the warm-up has compiled
everything, rank 0 saves ``torch.compiler.save_cache_artifacts()`` (inductor's compiled graphs,
Triton kernels and autotuning results, one blob) as ``<checkpoint.dir>/compile-cache/<key>.bin``
with its sha256 beside it; at start-up every rank loads the blob of its key before it compiles.

The key hashes what decides what gets compiled: the torch, CUDA and Python versions, the device
(GPU name or CPU), the world size and strategy, the resolved fast path, and the config sections the
compiled step depends on. A blob of another key is never read. A damaged blob (wrong checksum, or
torch refuses it) is ignored with a warning, and the run compiles from scratch and writes a new
one. The newest ``KEEP`` blobs stay.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import warnings
from pathlib import Path
from typing import Any

import torch

FOLDER = "compile-cache"
KEEP = 4


def key(cfg: Any, rt: Any, fast: Any) -> str:
    """16 hex digits naming the blob for this torch, device, world and config."""
    device = torch.cuda.get_device_name(rt.device) if rt.cuda else f"cpu-{platform.machine()}"
    parts = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(), "device": device,
        "world_size": rt.world_size, "strategy": rt.strategy, "fast": dataclasses.asdict(fast),
        "model": dataclasses.asdict(cfg.model), "dist": dataclasses.asdict(cfg.dist), "optim": dataclasses.asdict(cfg.optim),
        "train": {k: getattr(cfg.train, k) for k in ("batch_size", "precision", "param_dtype", "deterministic", "strategy")},
        "data": {k: getattr(cfg.data, k) for k in ("crop_padding", "crop_mode", "flip", "flip_mode")},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def paths(root: Path, name: str) -> tuple[Path, Path]:
    blob = root / FOLDER / f"{name}.bin"
    return blob, blob.with_suffix(".sha256")


def load(root: Path, name: str) -> str:
    """Load this key's blob into torch's compile caches, before anything is compiled. Returns what
    happened, for the start line and metrics: 'loaded N artifacts', 'none', or 'damaged'."""
    blob, digest = paths(root, name)
    if not blob.is_file():
        return "none"
    try:
        data = blob.read_bytes()
        if not digest.is_file() or hashlib.sha256(data).hexdigest() != digest.read_text().strip():
            raise ValueError("checksum mismatch")
        info = torch.compiler.load_cache_artifacts(data)
        if info is None:  # torch logs why and gives up on blobs it cannot read
            raise ValueError("torch could not read it")
    except Exception as e:  # noqa: BLE001 - any failure here only costs a cold compile
        warnings.warn(f"ignoring the damaged compile cache {blob} ({e.__class__.__name__}: {e}); compiling from scratch", stacklevel=2)
        return "damaged"
    count = sum(len(v) for v in getattr(info, "artifacts", {}).values())
    return f"loaded {count} artifacts"


def save(root: Path, name: str) -> int:
    """Rank 0, after the warm-up compiled the step: write this key's blob (atomically) and keep the
    newest KEEP. Returns the bytes written (0 when torch had nothing to save)."""
    blob, digest = paths(root, name)
    try:
        out = torch.compiler.save_cache_artifacts()
        if out is None:
            return 0
        data = out[0]
        blob.parent.mkdir(parents=True, exist_ok=True)
        for path, content in ((blob, data), (digest, hashlib.sha256(data).hexdigest().encode())):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(content)
            os.replace(tmp, path)  # a crash mid-write leaves the old blob or none, never half of one
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written costs the next start a compile, not this run
        warnings.warn(f"could not save the compile cache {blob} ({e.__class__.__name__}: {e}); the next start compiles again", stacklevel=2)
        return 0
    blobs = sorted(blob.parent.glob("*.bin"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in blobs[KEEP:]:
        old.unlink(missing_ok=True)
        old.with_suffix(".sha256").unlink(missing_ok=True)
    return len(data)
