"""One writer per run folder: :class:`FolderLock` on ``checkpoint.dir/.lock``. No torch: the
launcher's ``trainer check`` takes it before any worker starts."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from trainer.files import flock
from trainer.runfolder import LOCK
from trainer.worker.checkpoint.folder import CheckpointError


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
        return CheckpointError(
            f"checkpoint.dir={self.root} is in use by another run ({_holder_text(info)}); stop that run, or set "
            f"checkpoint.dir to another folder"
        )

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
                say(
                    f"warning: broke the lock of {_holder_text(info)} (no heartbeat for over {self.stale_s:.0f} s: a "
                    f"dead host); moved it to {aside.name}"
                )
                continue
            if time.monotonic() >= deadline:
                raise self._busy(info)
            time.sleep(0.5)
        self._fd = fd
        now = time.time()
        self._info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": now,
            "heartbeat": now,
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        }
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
