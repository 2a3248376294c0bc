"""Small file helpers that several modules share: a file's sha256, a write that a reader never sees
half done, an exclusive lock the kernel drops when its holder dies. The standard library only."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_parts(path: Path, part_bytes: int, threads: int | None = None) -> list[str]:
    """The sha256 of each ``part_bytes`` slice of ``path``, hashed side by side: hashlib lets go
    of the GIL while it hashes, so a 2.4 GB checkpoint takes about a part's time per thread
    instead of the whole file's on one core (the verify before a resume is on its critical path)."""
    size = path.stat().st_size
    threads = threads or min(8, os.cpu_count() or 1)

    def part(i: int) -> str:
        h, offset, end = hashlib.sha256(), i * part_bytes, min(size, (i + 1) * part_bytes)
        with open(path, "rb", buffering=0) as fh:
            while offset < end and (block := os.pread(fh.fileno(), min(1 << 24, end - offset), offset)):
                h.update(block)
                offset += len(block)
        return h.hexdigest()

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(part, range(-(-size // part_bytes))))


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
