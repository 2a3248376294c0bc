"""Checkpoints: the one owner of what a checkpoint holds, how it is written, picked, verified
and restored (:class:`Checkpointer`), and of the run folder's single-writer lock (:class:`FolderLock`).

Bytes. A save writes ``state.pt`` (hashed while it is written) and ``meta.json`` (step, epoch, size,
the file's sha256 and one per 64 MiB part, which a resume checks side by side) into a hidden temporary folder, fsyncs both and the folder, then renames the folder to
``step-N`` and fsyncs the parent. The rename is the commit: a crash at any moment leaves either no
``step-N`` or a complete one, and a half-written temporary folder is never taken for a checkpoint
(it is removed at the next start). On resume the newest ``step-N`` whose size and checksum match
is used; a damaged one is reported, renamed ``step-N.corrupt`` and skipped for the one before.
Loading uses ``weights_only=True``: a checkpoint is untrusted input and a pickle that would run
code is refused.

State. A checkpoint holds the parts a run registers (``model``, ``optimizer``, ``masters`` with
bf16 weights, ``scheduler``, ``lookahead``, and the train counters at the top level), each with
``state_dict()`` and ``load_state_dict()`` and each the one owner of its state, plus the model's
name and the resolved config. The model and optimizer go through
``torch.distributed.checkpoint.state_dict``: full tensors by parameter name for every strategy, so
any checkpoint resumes under any strategy and world size. Restoring gives every tensor back with
the dtype, device and memory format (strides) of the live run: a channels-last weight's momentum
buffer comes back channels-last, which the fused optimizers require.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from trainer.config import Config, ConfigError
from trainer.config_loader import to_dict
from trainer.contract import one_line, say
from trainer.files import flock, sha256, sha256_parts
from trainer.worker import models
from trainer.worker.faults import crash_point
from trainer.worker.models import unwrap

STATE, META = "state.pt", "meta.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
SET_ASIDE = re.compile(r"^step-\d+\.(corrupt\d*|replaced-\d+)$")
LOCK = ".lock"
FORMAT = 1
PART_BYTES = 1 << 26
"""The slice of ``state.pt`` that one sha256 of ``meta.json``'s ``parts`` covers: a resume hashes the
parts in threads. The whole file's sha256 is kept beside them for readers that know only it."""
KEEP_SET_ASIDE = 2
"""Quarantined (``.corrupt``) and replaced (``.replaced-*``) folders kept for inspection; older
ones are deleted with a warning, so a crash loop cannot fill the volume with them."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (missing, not a checkpoint, damaged, or another model's)."""


class _HashingWriter:
    """File wrapper for torch.save: hashes the bytes on their way to disk (no second read), the
    whole file and each PART_BYTES part."""

    def __init__(self, fh):
        self.fh, self.sha, self.size = fh, hashlib.sha256(), 0
        self.part, self.parts = hashlib.sha256(), []

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        done = 0
        while done < len(view):
            piece = view[done:done + PART_BYTES - (self.size + done) % PART_BYTES]
            self.part.update(piece)
            done += len(piece)
            if (self.size + done) % PART_BYTES == 0:
                self.parts.append(self.part.hexdigest())
                self.part = hashlib.sha256()
        self.size += len(view)
        return self.fh.write(data)

    def part_digests(self) -> list[str]:
        return self.parts + ([self.part.hexdigest()] if self.size % PART_BYTES else [])

    def flush(self) -> None:
        self.fh.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    parts = meta.get("parts")
    if parts:  # written since the parts were added: checked in threads
        good = sha256_parts(folder / STATE, parts["bytes"]) == parts["sha256"]
    else:
        good = sha256(folder / STATE) == meta.get("sha256")
    if not good:
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


def prune_set_aside(root: Path, keep: int = KEEP_SET_ASIDE, say=print) -> list[Path]:
    """Delete all but the newest ``keep`` quarantined or replaced folders (by modification time)."""
    aside = sorted((p for p in root.iterdir() if SET_ASIDE.match(p.name) and p.is_dir()), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    gone = aside[:-keep] if keep else aside
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    if gone:
        say(f"warning: deleted {len(gone)} set-aside checkpoint folder(s) ({', '.join(p.name for p in gone)}); the newest {keep} are kept for inspection")
    return gone


def newest_good(root: Path, say=print) -> Path | None:
    """The newest verified checkpoint in ``root``; damaged ones are reported and set aside."""
    for _, folder in reversed(complete(root)):
        try:
            verify(folder)
            return folder
        except CheckpointError as e:
            moved = quarantine(folder)
            say(f"warning: {e}; skipped it (moved to {moved.name}) and trying the previous one")
            prune_set_aside(root, say=say)
    return None


def newest_complete(root: Path) -> Path | None:
    """The newest checkpoint with a completion marker, unverified: what ``resume=auto`` will try
    first (launchers check its model before starting workers)."""
    found = complete(root)
    return found[-1][1] if found else None


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


def check_classes(saved: list[str] | None, data: list[str] | None, where: Path) -> None:
    """A checkpoint's head has one output per class of the data it was trained on, in order."""
    if saved is None or data is None or list(saved) == list(data):
        return
    first = next((f"{a!r} is {b!r} here" for a, b in zip(saved, data, strict=False) if a != b), f"{len(saved)} classes, {len(data)} here")
    raise CheckpointError(f"checkpoint {where} was trained on other classes ({first}); point data.dir at the data it was trained on, "
                          f"or start a new run in another checkpoint.dir")


def check_global_batch(saved: int | None, wanted: int, where: Path) -> None:
    """A checkpoint counts in its own global batches (the step, the place in the epoch, the
    schedule's progress): resumed with another, the run would skip or repeat images of the epoch
    and take its learning rate past the schedule's end."""
    if saved is not None and saved != wanted:
        raise CheckpointError(f"checkpoint {where} was saved with train.batch_size={saved} but this run has train.batch_size={wanted}; "
                              f"its step, place in the epoch and learning-rate schedule count batches of {saved}: resume with "
                              f"train.batch_size={saved} (on any number of processes that divides it) or use another checkpoint.dir")


def saved_batch(state: dict) -> int | None:
    return (state.get("config") or {}).get("train", {}).get("batch_size")


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
        why = one_line(e, 160)
        raise CheckpointError(f"{state_file} is not a loadable trainer checkpoint ({e.__class__.__name__}: {why}); pass a step-N folder written by `trainer train`") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "model" not in state:
        raise CheckpointError(f"{state_file} is not a trainer checkpoint (no format/model entries); pass a step-N folder written by `trainer train`")
    return state


def space_needed(root: Path, state_bytes: int, keep: int) -> int:
    """Free bytes a run needs on top of what its folder holds: a save writes the new checkpoint
    before it deletes the oldest, so keep-K peaks at K + 1 checkpoints."""
    have = min(len(complete(root)), keep)
    return max(1, keep + 1 - have) * state_bytes


def _owner_hint(root: Path, e: OSError) -> str:
    """For a permission error: whose folder it is, when that is not us. The usual cause is a bind
    mount that the container engine created, as root, because it did not exist yet."""
    if e.errno != errno.EACCES:
        return ""
    folder = next((p for p in (root, *root.parents) if p.exists()), None)
    if folder is None or folder.stat().st_uid == os.getuid():
        return ""
    return (f": {folder} belongs to uid {folder.stat().st_uid}, this process runs as uid {os.getuid()}; "
            f"create the folder as the user that runs the job before the container starts (mkdir -p), or run as its owner (-u UID:GID)")


def probe(root: Path, need_bytes: int, keep: int | None = None) -> None:
    """Fail now, not after an hour, when ``root`` is unwritable or has no room for the checkpoints
    the run will keep (``need_bytes`` is one checkpoint; ``keep`` K means K + 1 at a save)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        test = root / f".write-probe-{os.getpid()}"
        with open(test, "wb") as fh:
            fh.write(os.urandom(1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
        test.unlink()
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir={root} is not writable ({e.strerror}{_owner_hint(root, e)}); mount it read-write or set checkpoint.dir to a writable folder") from None
    free = shutil.disk_usage(root).free
    need = need_bytes if keep is None else space_needed(root, need_bytes, keep)
    if free < need * 1.1:
        what = "one checkpoint needs" if keep is None else f"checkpoint.keep={keep} needs (K + 1 checkpoints at a save, {need_bytes / 1e9:.2f} GB each)"
        raise CheckpointError(
            f"checkpoint.dir={root} has {free / 1e9:.2f} GB free but {what} about {need / 1e9:.2f} GB more; "
            f"free space, lower checkpoint.keep, or point checkpoint.dir at a larger volume"
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
                "sha256": writer.sha.hexdigest(), "parts": {"bytes": PART_BYTES, "sha256": writer.part_digests()},
                "model": state.get("model_name"), "batch_size": saved_batch(state), "classes": state.get("classes"),
                "time": time.time()}
        with open(tmp / META, "w") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        crash_point("before-rename", step)
        final = root / f"step-{step}"
        replaced = final.exists()
        if replaced:  # a rewound run saving a step again: set the old one aside, never lose it
            final.rename(root / f"step-{step}.replaced-{time.time_ns()}")
        tmp.rename(final)
        _fsync_dir(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        failure = _os_error(e)
        if failure is not None:  # a full, read-only or vanished volume: say so, do not crash-loop
            raise CheckpointError(_write_failed(state, root, step, failure)) from None
        raise
    for _, old in complete(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    if replaced:
        prune_set_aside(root, say=lambda m: say(m))
    return final


def _os_error(e: BaseException | None) -> OSError | None:
    """The file-system error behind ``e`` (torch.save wraps it in a RuntimeError of its own)."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _write_failed(state: dict, root: Path, step: int, e: OSError) -> str:
    try:
        free = f"{shutil.disk_usage(root).free / 1e9:.2f} GB free"
    except OSError:
        free = "free space unknown"
    newest = newest_complete(root)
    kept = f"the newest complete checkpoint is {newest.name}" if newest else "no complete checkpoint exists yet"
    return (f"could not write checkpoint step-{step} into {root}: {e.strerror or e} (it needs about {_tensor_bytes(state) / 1e9:.2f} GB, "
            f"{free}); {kept}; free space or point checkpoint.dir at a larger volume, then run again to resume")


# --------------------------------------------------------------------------------------------
# One writer per run folder.


def _holder_text(info: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    age = max(0, int(time.time() - info.get("heartbeat", 0)))
    return f"pid {info.get('pid')} on {info.get('host')}, since {since}, last heard from {age} s ago"


LOCK_RECORD_BYTES = 512
"""The lock file's size: its JSON record padded with spaces (see FolderLock._write)."""


class FolderLock:
    """An exclusive lock on ``checkpoint.dir/.lock``, held by the writing process (rank 0) for its
    whole life, with who holds it (host, pid, since, heartbeat) inside the file.

    The lock itself is ``flock``: the kernel drops it when the holder dies, kill -9 included, so a
    dead run never blocks the next one. Network file systems forward it to the server (NFSv4,
    Lustre, CephFS, GPFS); there a lock left by a dead *host* lasts until the server expires it,
    and one whose heartbeat is older than ``stale_s`` is broken (the file moved aside) rather
    than waited on for ever. Where the file system has no locks at all, the heartbeat alone decides.
    """

    def __init__(self, root: Path, heartbeat_s: float = 15.0, stale_s: float = 120.0):
        self.root, self.path = Path(root), Path(root) / LOCK
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self._fd: int | None = None
        self._stop = threading.Event()
        self._info: dict = {}

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def _stale(self, info: dict) -> bool:
        """A holder on another host that has not written its heartbeat for stale_s (a dead host),
        or for two heartbeats when it is this job's own earlier rank 0 (its host was lost, and the
        group re-formed with rank 0 elsewhere)."""
        if not info or info.get("host") == socket.gethostname():
            return False
        age = time.time() - info.get("heartbeat", 0)
        return age > self.stale_s or (_same_job(info) and age > 2 * self.heartbeat_s)

    def _busy(self, info: dict) -> CheckpointError:
        return CheckpointError(f"checkpoint.dir={self.root} is in use by another run ({_holder_text(info)}); stop that run, or set checkpoint.dir to another folder")

    def _try(self) -> int | None:
        """An fd holding the lock, or None when another process holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            held = flock(fd, wait=False)
        except OSError:  # no locks on this file system (ENOLCK, EOPNOTSUPP): the heartbeat decides
            info = self._read()
            alive = info and (time.time() - info.get("heartbeat", 0) <= self.stale_s) and info.get("pid") != os.getpid()
            if alive and info.get("host") == socket.gethostname():
                alive = _pid_alive(info.get("pid", -1))
            if alive:
                os.close(fd)
                return None
            return fd
        # another holds it, or moved aside as stale meanwhile
        if not held or os.fstat(fd).st_ino != os.stat(self.path).st_ino:
            os.close(fd)
            return self._try() if held else None
        return fd

    def check(self) -> None:
        """Raise CheckpointError if a live run holds the folder (takes and drops the lock)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = self._try()
        if fd is None:
            info = self._read()
            if not self._stale(info):
                raise self._busy(info)
            return
        os.close(fd)

    def acquire(self, wait_s: float = 0.0, say=print) -> None:
        """Take the lock for this process, or raise CheckpointError naming the holder (after
        waiting up to ``wait_s`` for it to go: a restarted group's old rank 0 may still be exiting)."""
        self.root.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        while (fd := self._try()) is None:
            info = self._read()
            # this job's earlier rank 0 (a re-form moved rank 0): wait until its heartbeat goes stale
            deadline = start + (max(wait_s, 3 * self.heartbeat_s) if _same_job(info) else wait_s)
            if self._stale(info):
                aside = self.path.with_name(f"{LOCK}.stale-{time.time_ns()}")
                self.path.rename(aside)
                say(f"warning: broke the lock of {_holder_text(info)} (no heartbeat for over {self.stale_s:.0f} s: a dead host); moved it to {aside.name}")
                continue
            if time.monotonic() >= deadline:
                raise self._busy(info)
            time.sleep(0.5)
        self._fd = fd
        now = time.time()
        self._info = {"host": socket.gethostname(), "pid": os.getpid(), "since": now, "heartbeat": now,
                      "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}
        self._write()
        threading.Thread(target=self._beat, name="checkpoint-lock-heartbeat", daemon=True).start()

    def _write(self) -> None:
        """The holder's record, padded to a fixed size and written over the old in one call: a
        reader never finds the file empty (truncating first left a window in which one did, and,
        on a file system without locks, took a held folder for a free one)."""
        data = json.dumps(self._info).encode()
        os.pwrite(self._fd, data.ljust(max(LOCK_RECORD_BYTES, len(data))), 0)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._info["heartbeat"] = time.time()
            try:
                self._write()
            except OSError:  # a full or vanished volume: the save reports it, not this thread
                pass

    def release(self) -> None:
        self._stop.set()
        if self._fd is not None:
            os.close(self._fd)  # closing the last fd drops the flock
            self._fd = None


def _same_job(info: dict) -> bool:
    """The lock's holder is a worker of this torchrun job (same rendezvous id)."""
    return info.get("run_id") not in (None, "", "none") and info.get("run_id") == os.environ.get("TORCHELASTIC_RUN_ID")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------------------------
# What a checkpoint holds: Stateful parts, each with state_dict() / load_state_dict().


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainState:
    """The loop's counters (saved at the top level of a checkpoint)."""

    epoch: int = 0
    """Epoch in progress (epochs finished so far)."""
    epoch_step: int = 0
    """Steps finished inside that epoch: a resumed run skips these global batches."""
    step: int = 0
    """Optimizer steps finished in all."""

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "epoch_step": self.epoch_step, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.epoch_step, self.step = state["epoch"], state["epoch_step"], state["step"]


# Through torch.distributed.checkpoint.state_dict, the same calls for every strategy: the plain
# module's names (no ``module.``/``_orig_mod.`` prefix), full tensors (gathered under fsdp, where
# every rank must call), optimizer state keyed by parameter name so that a checkpoint of any
# strategy and world size resumes under any other.
def _full(strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # no cpu_offload: a GPU tensor goes to host memory once, in the save's own (pinned) copy
    return StateDictOptions(full_state_dict=True, strict=strict)


class ModelPart:
    """The model's weights and buffers."""

    def __init__(self, model: nn.Module, name: str):
        self.model, self.name = unwrap(model), name
        # Imported while the run is built, not at its first use: the import costs about 0.2 s on
        # an H200 node, which the first step's reserve() would otherwise add to epoch 0 (the speed
        # recipe's 1.70 s became 1.90 s). Not at module level: `trainer check` needs none of it.
        import torch.distributed.checkpoint.state_dict  # noqa: F401

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=_full())

    def load_state_dict(self, state: dict, where: Path | str = "checkpoint") -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        try:
            # copies into the live tensors: their layout stays
            set_model_state_dict(self.model, dict(state), options=_full())
        except (RuntimeError, KeyError) as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            detail = lines[1] if len(lines) > 1 else (lines[0] if lines else repr(e))
            raise CheckpointError(f"checkpoint {where} does not fit model {self.name} ({detail}); use a checkpoint of this model") from None


class OptimizerPart:
    """The optimizer's state and param groups, by parameter name."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = unwrap(model), optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # An optimizer without state yet (SGD without momentum) first takes one step of zero
        # gradients at lr 0 inside torch: nothing moves.
        return get_optimizer_state_dict(self.model, self.optimizer, options=_full())

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's state per parameter, under this run's settings: a resume with other
        optim settings (momentum switched off or on, another weight decay) runs with the new ones,
        as a part switched on later (Lookahead) starts afresh. The learning rate stays the
        schedule's."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if len(state["param_groups"]) != len(self.optimizer.param_groups):
            raise CheckpointError(f"the checkpoint's optimizer has {len(state['param_groups'])} parameter groups, this run's "
                                  f"{len(self.optimizer.param_groups)}; resume with the optim settings it was saved with")
        settings = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in self.optimizer.param_groups]
        stateless = isinstance(self.optimizer, torch.optim.SGD) and not any(g["momentum"] for g in self.optimizer.param_groups)
        if stateless or not any(isinstance(v, torch.Tensor) for per_param in state["state"].values() for v in per_param.values()):
            # Nothing per parameter to restore (SGD without momentum, as seed.yaml, now or when
            # saved): torch's loader learns the device from state tensors and fails without any
            # ("Expected device to be set"). The saved groups give the schedule's learning rate;
            # the rest of their settings are this run's again just below.
            for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        else:
            # not strict: parameters with no state of their own (bf16 weights: their masters' momentum
            # is the masters' part) or none yet (a momentum-free group) are legitimate
            set_optimizer_state_dict(self.model, self.optimizer, state, options=_full(strict=False))
            self._match_parameters()
        for group, own in zip(self.optimizer.param_groups, settings, strict=True):
            group.update(own)

    @torch.no_grad()
    def _match_parameters(self) -> None:
        """Per-parameter state (momentum, Adam's moments) in its parameter's exact layout.
        ``Optimizer.load_state_dict`` keeps the strides the tensors were saved with; a checkpoint
        written by an older version (or by another memory format) would then hand the fused kernels
        a channels-last weight with a contiguous momentum buffer, which they refuse."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and v.stride() != p.stride():
                        self.optimizer.state[p][key] = torch.empty_like(p, dtype=v.dtype).copy_(v)


# --------------------------------------------------------------------------------------------
# Asynchronous saves: snapshot to (pinned) host memory, the only stall; write in a thread.


def _snapshot(obj: Any, buffers: dict, pin: bool, key: str = "") -> Any:
    """A host copy of ``obj`` (nested dicts/lists of tensors) in reused buffers that keep every
    tensor's dtype, shape and strides (``empty_like`` preserves a dense tensor's memory format:
    a channels-last weight stays channels-last, as a synchronous save would keep it)."""
    if isinstance(obj, torch.Tensor):
        buf = buffers.get(key)
        if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype or buf.stride() != obj.stride():
            buf = buffers[key] = torch.empty_like(obj, device="cpu", pin_memory=pin and obj.device.type == "cuda")
        return buf.copy_(obj.detach(), non_blocking=buf.is_pinned())
    if isinstance(obj, dict):
        return {k: _snapshot(v, buffers, pin, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v, buffers, pin, f"{key}/{i}") for i, v in enumerate(obj))
    return obj


class AsyncWriter:
    """One background write at a time; a new save first waits for the previous one."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pin = torch.cuda.is_available()

    def _copy(self, state: dict) -> dict:
        snap = _snapshot(state, self._buffers, self._pin)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the stall: device-to-host copies finish here
        return snap

    def reserve(self, state: dict) -> None:
        """Allocate the host buffers for ``state`` ahead of the first save (pinning gigabytes takes
        a second or more)."""
        self._copy(state)

    def save(self, state: dict, root: Path, step: int, keep: int) -> None:
        self.wait()
        snap = self._copy(state)

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


# --------------------------------------------------------------------------------------------
# The one owner.


def state_bytes(cfg: Config) -> int:
    """Bytes of one checkpoint: the weights, plus one copy per optimizer state tensor and Lookahead,
    plus half for bf16 working weights beside their fp32 masters (the upper bound under auto)."""
    with torch.device("meta"), models.ShapesOnly():  # shapes only: no memory, no time
        model = models.build(cfg.model.name, 10, cfg.data.image_size or 32)  # the head's classes: a rounding error of the size
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    copies = 1 + (2 if cfg.optim.name == "adamw" else int(cfg.optim.momentum > 0)) + int(cfg.optim.lookahead_every > 0)
    return int(n * (copies + 0.5 * (cfg.train.param_dtype != "fp32")))


class Checkpointer:
    """Picks the checkpoint to resume from, restores it into the registered parts, and saves them
    (synchronously, or through a pinned snapshot and a background write). Rank 0 writes; every
    rank calls :meth:`save` (under fsdp the state is gathered collectively).

    A resume: ``claim_and_pick`` (rank 0) before anything is built, then, once every part exists
    and is registered, one ``restore``."""

    def __init__(self, cfg: Config, is_main: bool, async_save: bool, say=print):
        self.cfg, self.is_main, self.say = cfg, is_main, say
        self.root = Path(cfg.checkpoint.dir)
        self.parts: dict[str, Stateful] = {}
        self.writer = AsyncWriter() if async_save and is_main else None
        self.async_save = async_save
        self.lock = FolderLock(self.root)
        self.classes: list[str] | None = None
        """The data's class names (saved; a resume on other classes is refused)."""

    # -- claiming the folder, picking the checkpoint (rank 0) -------------------------------------------------------------------
    def claim_and_pick(self) -> Path | None:
        """Rank 0, before anything is written: the folder is writable and has room, this process
        holds it alone, leftovers are cleaned; returns the checkpoint to resume from (or None)."""
        probe(self.root, state_bytes(self.cfg), self.cfg.checkpoint.keep)
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        self.lock.acquire(wait_s=30.0 if restarted else 0.0, say=self.say)
        resume = self.cfg.checkpoint.resume
        path = explicit_resume(self.root, resume)
        clean_temporaries(self.root)
        return newest_good(self.root, say=self.say) if resume == "auto" else path

    # -- restoring ----------------------------------------------------------------------------
    def restore(self, path: Path) -> None:
        """Load the checkpoint at ``path`` into every registered part, in registration order
        (the model first). Rank 0 verified size and checksum when it picked it under resume=auto;
        an explicit path is verified here. A part the checkpoint lacks (Lookahead switched on
        later, bf16 weights after an fp32 run) starts from the restored weights."""
        state = load(path, verify_checksum=self.is_main and self.cfg.checkpoint.resume != "auto")
        check_model(state.get("model_name"), self.cfg.model.name, path)
        check_global_batch(saved_batch(state), self.cfg.train.batch_size, path)
        check_classes(state.get("classes"), self.classes, path)
        for key, part in self.parts.items():
            if key == "train":
                part.load_state_dict(state)
            elif key == "model":
                part.load_state_dict(state["model"], path)  # type: ignore[call-arg]
            elif state.get(key) is not None:
                part.load_state_dict(state[key])
            elif hasattr(part, "from_model"):
                self.say(f"{path} has no {key} state; it starts from the checkpoint's weights")
                part.from_model()

    # -- saving -------------------------------------------------------------------------------
    def register(self, **parts: Stateful | None) -> None:
        self.parts.update({k: v for k, v in parts.items() if v is not None})

    def collect(self) -> dict | None:
        """The full state to save: rank 0 gets it, other ranks None (a collective under fsdp)."""
        states = {k: p.state_dict() for k, p in self.parts.items()}
        if not self.is_main:
            return None
        train = states.pop("train", {})
        return {"format": FORMAT, "model_name": self.cfg.model.name, "classes": self.classes, **states, **train, "config": to_dict(self.cfg)}

    def reserve(self) -> None:
        """Host buffers for async saves, once the optimizer state exists (after the first step)."""
        if self.async_save:
            state = self.collect()  # every rank: a collective under fsdp
            if self.writer is not None:
                self.writer.reserve(state)

    def save(self, step: int, sync: bool) -> tuple[float, bool] | None:
        """Write ``step-N`` from the registered parts; (stall seconds, async) on rank 0, else None.
        Only the copy to host memory stalls training when async."""
        state = self.collect()
        if state is None:
            return None
        t0 = time.perf_counter()
        keep = self.cfg.checkpoint.keep
        if self.writer is not None and not sync:
            self.writer.save(state, self.root, step, keep)
        else:
            self.wait()
            write(state, self.root, step, keep)
        return time.perf_counter() - t0, self.writer is not None and not sync

    def wait(self) -> None:
        if self.writer is not None:
            self.writer.wait()

    def close(self) -> None:
        self.lock.release()
