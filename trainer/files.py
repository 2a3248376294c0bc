"""Small file helpers that several modules share: a file's sha256, a write that a reader never sees
half done, an exclusive lock the kernel drops when its holder dies. The standard library only."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path


def sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def replacing(path: Path):
    """A temporary path beside ``path`` to write; renamed over ``path`` when the block ends well, so
    that a reader finds the old file or the new one, never a part; removed when it fails."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def flock(fd: int, wait: bool = True) -> bool:
    """Take the exclusive ``flock`` on ``fd``: the kernel drops it when the holder dies (kill -9
    included), and network file systems forward it to their server. False when another process
    holds it and ``wait`` is off; OSError where the file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True
