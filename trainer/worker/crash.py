"""What a worker says when it fails: one line on the console, the traceback in the run folder.

A lost peer (its host crashed, its link cut) reaches every surviving rank as an exception from
deep inside autograd or a collective: gloo's ``Read error [10.1.0.11]:40567: Connection reset by
peer``, NCCL's remote error, a collective timeout. The console gets one line that says which rank
and host was lost or did not answer, at which step, and what happens next (torchrun goes back to its
rendezvous to re-form the group from the newest checkpoint, or the launcher's retry resumes); the whole traceback goes
to
``<run folder>/error-rank<R>.txt``. Any other crash reads the same way, naming the exception.

The kind of failure comes from torch's typed errors first (``DistNetworkError``: a peer or the
store unreachable; ``DistStoreError``: a store wait timed out), then from the text: gloo raises a
plain ``RuntimeError`` for both a lost peer and a timed-out collective (torch 2.14: ``Read error
[addr]:port: Connection reset by peer``, ``Timed out waiting 8000ms for recv``), and NCCL one
``DistBackendError`` for a remote error and a watchdog timeout alike.
"""

from __future__ import annotations

import os
import re
import socket
import time
import traceback
from pathlib import Path

from trainer.contract import say

LOST = re.compile(
    r"Connection reset by peer|Connection refused|Connection closed by peer|Broken pipe|Read error|Write error|"
    r"remote process exited|network error|ncclRemoteError|Socket Timeout|EPIPE|ECONNRESET",
    re.IGNORECASE,
)
TIMED_OUT = re.compile(r"Timed out waiting|collective operation timeout|timed out", re.IGNORECASE)
COLLECTIVE = re.compile(r"gloo|nccl|collective|all_?reduce|barrier|recv|send", re.IGNORECASE)
ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")


def host_addresses() -> list[str]:
    """This host's addresses as peers see them (its name resolved; a gloo peer in an error message
    is one of these)."""
    try:
        return sorted(set(socket.gethostbyname_ex(socket.gethostname())[2]))
    except OSError:
        return []


def lost_ranks(message: str, hosts: list[tuple[str, list[str]]]) -> list[tuple[int, str]]:
    """(rank, host) of the peers whose address ``message`` names, from the table of every rank's
    host and addresses (gathered when the group formed)."""
    named = set(ADDRESS.findall(message))
    return [(r, host) for r, (host, addrs) in enumerate(hosts) if named & set(addrs)]


def what_next(root: Path | None) -> str:
    """What happens after this worker exits: torchrun's restart, or the launcher's retry."""
    newest = _newest_step(root)
    where = f"from {newest}" if newest else "from the start (no checkpoint yet)"
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return f"run the same command to resume {where}"
    left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    if left > 0:
        # what torchrun does now, not what comes of it: whether the group re-forms is known only at
        # the rendezvous, and the launcher's console says it then (re-formed, or cannot reach it)
        return f"torchrun goes back to its rendezvous to re-form the group {where} ({left} restart(s) left)"
    return f"no torchrun restart left: the launcher's retry resumes {where}"


def _newest_step(root: Path | None) -> str:
    if root is None:
        return ""
    from trainer.worker.checkpoint.folder import newest_complete

    try:
        found = newest_complete(root)
    except OSError:
        return ""
    return found.name if found else ""


def kind(error: BaseException) -> str:
    """'lost' (a peer or the store could not be reached), 'timeout' (a collective or a store wait
    ran out of time), or 'other': torch's error types first, the text where they do not tell."""
    import torch.distributed as dist  # loaded already: the error came from it, or this is no distributed failure

    message = f"{error}"
    if isinstance(error, dist.DistNetworkError) or LOST.search(message):
        return "lost"
    if isinstance(error, dist.DistStoreError) or (
        TIMED_OUT.search(message) and (isinstance(error, dist.DistError) or COLLECTIVE.search(message))
    ):
        return "timeout"
    return "other"


def describe(
    error: BaseException, rank: int, step: int | None, hosts: list[tuple[str, list[str]]], timeout_s: float, peers=None
) -> str:
    """The line's first half: who failed, what was lost, at which step. ``peers`` (the watchdog's
    view of the store) tells a rank that is gone from one that failed because of it: the peer
    whose connection broke first may only be a rank that exited on the same loss."""
    message = f"{error}"
    first = message.strip().splitlines()[-1][:200] if message.strip() else type(error).__name__
    at = f" at step {step}" if step is not None else " before the first step"
    me = f"rank {rank} ({socket.gethostname()})"
    failed = kind(error)
    lost_peer = failed == "lost"
    if not lost_peer and peers is not None:
        peers.note_failure()  # alive: the ranks that lost a connection to this one must not name it
    if lost_peer:
        named = [(r, h) for r, h in lost_ranks(message, hosts) if r != rank]  # whose connection broke
        silent = peers.lost(hosts) if peers is not None else None  # who noted no failure of its own
        # the broken connection's peer if it is silent; else the silent ones (the peer only failed because of them)
        lost = [x for x in named if x in silent] or silent if silent else named
        whom = ", ".join(f"rank {r} ({h})" for r, h in lost) or "a peer"
        return f"{me}: lost {whom}{at}: {_short(first)}"
    if failed == "timeout":
        # a host lost silently (no reset): whoever noted no failure
        silent = peers.lost(hosts) if peers is not None else None
        if silent:
            whom = ", ".join(f"rank {r} ({h})" for r, h in silent)
            return f"{me}: lost {whom}{at}: it did not answer a collective for dist.timeout_s={timeout_s:g} s"
        waited = f"a collective waited dist.timeout_s={timeout_s:g} s for a rank that did not answer"
        return f"{me}: {waited}{at}: {_short(first)}"
    return f"{me}: crashed{at}: {type(error).__name__}: {_short(first)}"


def _short(text: str) -> str:
    """The error without the C++ source location and torch's general advice after it."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.strip())
    return text.split(". This is typically caused")[0]


def report(
    error: BaseException,
    root: Path | None,
    rank: int,
    step: int | None,
    hosts: list[tuple[str, list[str]]],
    timeout_s: float,
    peers=None,
) -> str:
    """Write the traceback to ``root/error-rank<R>.txt`` and return the console line."""
    where = "stderr"
    text = "".join(traceback.format_exception(error))
    try:
        if root is None:
            raise OSError("no run folder yet")
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"error-rank{rank}.txt"
        with open(path, "a") as f:
            f.write(
                f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} ({socket.gethostname()}) pid {os.getpid()} "
                f"step {step}\n{text}\n"
            )
        where = str(path)
    except OSError:
        say(text)
    from trainer.worker.watchdog import flight_record

    record = flight_record(root, rank) if root is not None else ""
    return f"{describe(error, rank, step, hosts, timeout_s, peers)}; {what_next(root)}; traceback in {where}{record}"
