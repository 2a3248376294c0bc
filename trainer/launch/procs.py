"""A process's children and state, through psutil. Used by the supervisor (hung workers, an agent
left without workers) and by torchrun's rendezvous thread (trainer/launch/rendezvous.py)."""

from __future__ import annotations

import psutil

GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
"""Exited: a zombie is a child its parent has not reaped (a blocked agent never reaps its dead worker)."""


def has_children(pid: int) -> bool | None:
    """Whether the process has a live child now (exited ones it has not reaped do not count); None
    if the process itself is gone (nothing to tell)."""
    live = live_children(pid)
    return None if live is None else bool(live)


def live_children(pid: int) -> frozenset[int] | None:
    """The pids of the process's live children; None if the process itself is gone."""
    try:
        return frozenset(c.pid for c in psutil.Process(pid).children() if state(c.pid) not in (None, *GONE))
    except psutil.NoSuchProcess:
        return None


def kill_children(pid: int) -> None:
    """SIGKILL every child of ``pid`` (torchrun's workers): torchrun then restarts its group."""
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return
    for c in children:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass


def state(pid: int) -> str | None:
    """psutil's word for the process's state (stopped, disk-sleep, zombie ...), or None if gone."""
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None
