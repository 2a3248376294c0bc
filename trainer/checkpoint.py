"""Checkpoints: ``step-N/`` folders in ``checkpoint.dir``, written atomically by rank 0.

A save writes ``state.pt`` (hashed while it is written) and ``meta.json`` (step, epoch, size,
sha256) into a hidden temporary folder, fsyncs both and the folder, then renames the folder to
``step-N`` and fsyncs the parent. The rename is the commit: a crash at any moment leaves either no
``step-N`` or a complete one, and a half-written temporary folder is never taken for a checkpoint
(it is removed at the next start). On resume the newest ``step-N`` whose size and checksum match
is used; a damaged one is reported, renamed ``step-N.corrupt`` and skipped for the one before.
Loading uses ``weights_only=True``: a checkpoint is untrusted input and a pickle that would run
code is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError
from trainer.faults import crash_point

STATE, META = "state.pt", "meta.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
FORMAT = 1


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (missing, not a checkpoint, damaged, or another model's)."""


class _HashingWriter:
    """File wrapper for torch.save: hashes the bytes on their way to disk (no second read)."""

    def __init__(self, fh):
        self.fh, self.sha, self.size = fh, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()


def complete(root: Path) -> list[tuple[int, Path]]:
    """Checkpoints with a completion marker, oldest first (not yet verified)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / META).is_file()]
    return sorted(found)


def verify(folder: Path) -> dict:
    """meta.json of ``folder`` if its state file has the recorded size and checksum; else raise."""
    try:
        meta = json.loads((folder / META).read_text())
        size = (folder / STATE).stat().st_size
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder} is incomplete ({e.__class__.__name__})") from None
    if size != meta.get("bytes"):
        raise CheckpointError(f"checkpoint {folder} is truncated ({size} of {meta.get('bytes')} bytes)")
    if _sha256(folder / STATE) != meta.get("sha256"):
        raise CheckpointError(f"checkpoint {folder} is corrupted (checksum mismatch)")
    return meta


def quarantine(folder: Path) -> Path:
    target = folder.with_name(folder.name + ".corrupt")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.corrupt{n}")
    folder.rename(target)
    return target


def newest_good(root: Path, log=print) -> Path | None:
    """The newest verified checkpoint in ``root``; damaged ones are reported and set aside."""
    for _, folder in reversed(complete(root)):
        try:
            verify(folder)
            return folder
        except CheckpointError as e:
            moved = quarantine(folder)
            log(f"warning: {e}; skipped it (moved to {moved.name}) and trying the previous one")
    return None


def explicit_resume(root: Path, resume: str) -> Path | None:
    """The checks on checkpoint.resume that read no checkpoint: ``never`` refuses a folder that
    already holds checkpoints (nothing gets mixed or overwritten), a path must exist. Returns that
    path, or None for ``auto`` and ``never``."""
    if resume == "never":
        existing = complete(root)
        if existing:
            raise CheckpointError(f"checkpoint.dir={root} already holds checkpoints (newest {existing[-1][1].name}); use checkpoint.resume=auto to continue them, or another checkpoint.dir")
        return None
    if resume == "auto":
        return None
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"checkpoint.resume={resume} does not exist; pass a step-N folder, or checkpoint.resume=auto")
    return path


def check_model(saved: str | None, wanted: str, where: Path) -> None:
    if saved != wanted:
        raise CheckpointError(f"checkpoint {where} holds model {saved!r} but model.name={wanted}; set model.name={saved} or use another checkpoint.dir")


def clean_temporaries(root: Path) -> None:
    for p in root.glob(".tmp-step-*"):
        shutil.rmtree(p, ignore_errors=True)


def load(path: str | Path, verify_checksum: bool = True) -> dict:
    """Read a checkpoint (a step-N folder or its state.pt) with weights_only=True; its size and
    checksum are checked first unless the caller already did (``verify_checksum=False``)."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    state_file = p / STATE if p.is_dir() else p
    if not state_file.exists():
        raise CheckpointError(f"checkpoint {p} does not exist; pass a step-N folder from checkpoint.dir, or resume=auto")
    if verify_checksum and (folder / META).exists() and state_file.name == STATE:
        verify(folder)
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - pickle, zip and type errors all mean the same to the user
        why = " ".join(str(e).split())[:160]
        raise CheckpointError(f"{state_file} is not a loadable trainer checkpoint ({e.__class__.__name__}: {why}); pass a step-N folder written by `trainer train`") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "model" not in state:
        raise CheckpointError(f"{state_file} is not a trainer checkpoint (no format/model entries); pass a step-N folder written by `trainer train`")
    return state


def probe(root: Path, need_bytes: int) -> None:
    """Fail now, not after an hour, when ``root`` is unwritable or too small for one checkpoint."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        test = root / f".write-probe-{os.getpid()}"
        with open(test, "wb") as fh:
            fh.write(os.urandom(1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
        test.unlink()
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir={root} is not writable ({e.strerror}); mount it read-write or set checkpoint.dir to a writable folder") from None
    free = shutil.disk_usage(root).free
    if free < need_bytes * 1.1:
        raise CheckpointError(
            f"checkpoint.dir={root} has {free / 1e9:.2f} GB free but one checkpoint needs about {need_bytes / 1e9:.2f} GB; "
            f"free space or point checkpoint.dir at a larger volume"
        )


def write(state: dict, root: Path, step: int, keep: int) -> Path:
    """Atomically write ``state`` as ``root/step-N`` and keep the newest ``keep`` checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        with open(tmp / STATE, "wb") as fh:
            writer = _HashingWriter(fh)
            torch.save(state, writer)
            fh.flush()
            os.fsync(fh.fileno())
        meta = {"format": FORMAT, "step": step, "epoch": state.get("epoch"), "bytes": writer.size,
                "sha256": writer.sha.hexdigest(), "model": state.get("model_name"), "time": time.time()}
        with open(tmp / META, "w") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        crash_point("before-rename", step)
        final = root / f"step-{step}"
        if final.exists():  # a rewound run saving a step again: set the old one aside, never lose it
            final.rename(root / f"step-{step}.replaced-{time.time_ns()}")
        tmp.rename(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in complete(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------
# Asynchronous saves: snapshot to pinned host memory (the only stall), write in a thread.


def _snapshot(obj: Any, buffers: dict, key: str = "") -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            return obj.detach().clone()
        buf = buffers.get(key)
        if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
            buf = buffers[key] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
        return buf.copy_(obj.detach(), non_blocking=True)
    if isinstance(obj, dict):
        return {k: _snapshot(v, buffers, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v, buffers, f"{key}/{i}") for i, v in enumerate(obj))
    return obj


class AsyncWriter:
    """One background write at a time; a new save first waits for the previous one."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def reserve(self, state: dict) -> None:
        """Allocate the pinned buffers for ``state`` ahead of the first save (pinning gigabytes takes
        a second or more)."""
        if torch.cuda.is_available():
            _snapshot(state, self._buffers)
            torch.cuda.current_stream().synchronize()

    def save(self, state: dict, root: Path, step: int, keep: int) -> None:
        self.wait()
        snap = _snapshot(state, self._buffers)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the stall: device-to-host copies finish here

        def run():
            try:
                write(snap, root, step, keep)
            except BaseException as e:  # noqa: BLE001 - re-raised in wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            warnings.warn(f"background checkpoint write failed: {err}", stacklevel=2)
            raise err
