"""The process tree seen from /proc (Linux): a process's children, its state, killing its children.
Used by the supervisor (hung workers, an agent left without workers) and by torchrun's rendezvous
thread (trainer/rendezvous.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def children(pid: int) -> list[int] | None:
    """The process's children from /proc (exited ones it has not reaped included); None if /proc
    cannot say (not Linux, or a kernel without CONFIG_PROC_CHILDREN)."""
    tasks = Path(f"/proc/{pid}/task")
    files = list(tasks.glob("*/children")) if tasks.is_dir() else []
    if not files:
        return None
    found: list[int] = []
    for f in files:
        try:
            found += [int(c) for c in f.read_text().split()]
        except OSError:
            continue
    return found


def has_children(pid: int) -> bool | None:
    """Whether the process has a live child now (exited ones it has not reaped do not count: a
    blocked agent never reaps its dead worker); None if /proc cannot say."""
    found = children(pid)
    if found is None:
        return None
    return any(not (process_state(c) or "Z").startswith(("Z", "X")) for c in found)


def kill_children(pid: int) -> None:
    """SIGKILL every child of ``pid`` (torchrun's workers): torchrun then restarts its group."""
    for c in children(pid) or []:
        try:
            os.kill(c, signal.SIGKILL)
        except ProcessLookupError:
            pass


def process_state(pid: int) -> str | None:
    """The state letter and name from /proc (T (stopped), D (disk sleep), ...), or None if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return "?"
