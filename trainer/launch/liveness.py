"""What the supervisor watches while torchrun runs (trainer/launch/supervisor.py): a worker that made
no progress and cannot act on its own watchdog (stopped, frozen: its heartbeat file, written by
trainer/worker/watchdog.py, goes stale), and an agent left without workers longer than its
rendezvous can take. Each is ended with a line, so that torchrun, or the scheduler, starts again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.contract import EXIT_CRASH, say
from trainer.launch.procs import GONE, has_children, state
from trainer.launch.torchrun_args import endpoint, rdzv_conf
from trainer.runfolder import last_step

HEARTBEAT_MARGIN_S = 10.0
"""Past a worker's bound, so that its own watchdog, which can write its Python stacks, goes first."""


def stacks_from_outside(pid: int, timeout_s: float = 20.0) -> str:
    """The Python stacks of a process that cannot write its own (stopped, stuck in the kernel), read
    from its memory by py-spy (a dependency; it reads a stopped process without resuming it: the
    supervisor is the worker's ancestor, which ptrace's default scope allows), or why not."""
    spy = Path(sys.executable).with_name("py-spy")
    spy = str(spy) if spy.exists() else shutil.which("py-spy")
    if spy is None:
        return "(no Python stacks: py-spy is not installed, and the process could not run to write them)"
    try:
        p = subprocess.run(
            [spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(no Python stacks: py-spy failed: {type(e).__name__})"
    if p.returncode != 0:
        return f"(no Python stacks: py-spy could not read the process: {(p.stderr or p.stdout).strip()[:300]})"
    return "Python stacks read by py-spy:\n" + p.stdout


def kill_hung_workers(folder: Path, margin_s: float = HEARTBEAT_MARGIN_S) -> list[str]:
    """Kill every worker whose heartbeat file (trainer/worker/watchdog.py) is older than its bound plus
    ``margin_s``: it cannot act on its own watchdog (stopped, frozen). Returns what was said."""
    said = []
    for hb in folder.glob("hb-*"):
        try:
            info, age = json.loads(hb.read_text()), time.time() - hb.stat().st_mtime
        except (OSError, ValueError):
            continue
        if age <= info["bound_s"] + margin_s:
            continue
        hb.unlink(missing_ok=True)  # once per worker
        now = state(info["pid"])
        if now in (None, *GONE):
            continue  # gone already, or exited and not yet reaped by torchrun (its attempt is ending)
        step = last_step(folder, info["rank"])  # exact: the heartbeat file's is up to a second old
        step = info["step"] if step is None else step
        line = (
            f"trainer torchrun: rank {info['rank']} (pid {info['pid']}, {now}) has made no progress for {age:.0f} s "
            f"after step {step} and its own watchdog did not act (bound {info['bound_s']:.0f} s, dist.hang_timeout_s): "
            "killing it so that torchrun restarts from the newest checkpoint"
        )
        try:
            with open(info["hang_file"], "a") as f:
                f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n{stacks_from_outside(info['pid'])}\n")
        except OSError:
            pass
        try:
            os.kill(info["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        say(line)
        said.append(line)
    return said


LOST_RENDEZVOUS_MARGIN_S = 60.0
"""Past the longest legitimate wait of an agent without workers (its rendezvous' join_timeout)."""


class LostRendezvous:
    """Notices a torchrun agent that has had no worker for longer than its rendezvous can take: it is
    blocked on a store it cannot reach (the first node's network is cut, or that node is gone), where
    torchrun itself retries the read for ever. The first node's agent gives up at join_timeout on its
    own; this gives the others the same end, a crash code their scheduler retries."""

    def __init__(self, torchrun_args: list[str], pid: int):
        self.join_s = float(rdzv_conf(torchrun_args).get("join_timeout", 600))
        self.bound_s = self.join_s + LOST_RENDEZVOUS_MARGIN_S
        self.endpoint = endpoint(torchrun_args)
        self.pid, self.since = pid, time.monotonic()

    def check(self) -> str:
        """'' while all is well; else the line to say before ending torchrun."""
        workers = has_children(self.pid)
        if workers is None or workers:  # None: torchrun itself is gone (its exit is handled): never act on a guess
            self.since = time.monotonic()
            return ""
        idle = time.monotonic() - self.since
        if idle <= self.bound_s:
            return ""
        return (
            f"trainer torchrun: no worker has run on this node for {idle:.0f} s and torchrun still waits on the "
            f"rendezvous "
            f"at {self.endpoint} (join_timeout {self.join_s:.0f} s): the first node is unreachable or gone; "
            f"exiting {EXIT_CRASH} so that the scheduler starts the job again"
        )
