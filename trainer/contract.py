"""The exit status contract, and the hooks a worker uses to keep it under a launcher.

    0   finished
    75  stopped on a signal after saving a checkpoint of that step: run the same command to resume
    2   bad input (config, data, a checkpoint of another model, a run folder held by another run):
        do not retry, fix the input
    anything else: a crash (restart it; the run resumes from its newest complete checkpoint)

A worker alone keeps it (``python -m trainer train`` exits with these codes). Under torchrun the
supervisor keeps it (trainer/launch/supervisor.py): each worker records its code in the supervisor's
exit folder (``$TRAINER_EXIT_DIR``) as it leaves, and the supervisor turns torchrun's and the
workers' codes into the launcher's. Workers and launcher both import this module; it imports
no other module of the trainer but trainer/files.py, and not torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

from trainer.files import replacing

EXIT_OK = 0
EXIT_USAGE = 2
"""Bad config, bad input or a checkpoint that cannot be used: nothing was changed; do not retry."""
EXIT_PREEMPTED = 75
"""Stopped by a signal after saving a checkpoint of the last finished step (EX_TEMPFAIL): run the
same command again to resume."""
EXIT_CRASH = 1
EXIT_HUNG = 124
"""A worker's hang watchdog gave up on it (no progress within dist.hang_timeout_s; trainer/worker/watchdog.py):
a crash, restarted like one; 124 as timeout(1) exits."""

EXIT_DIR_ENV = "TRAINER_EXIT_DIR"
"""The supervisor's exit folder: the workers' exit records, heartbeats and the SIGNALLED mark."""
EXIT_RUNNING = -1
"""What a worker records when it starts: a group whose records still say so at the end was killed."""
SIGNALLED = "signalled"
"""A file in the exit folder: the supervisor passed a signal on (a stop without it is torchrun's own)."""
COMMAND_START_ENV = "TRAINER_COMMAND_START"
"""When the command started (time.time()): the first step's record reports the seconds since."""
RUN_DIR_ENV = "TRAINER_RUN_DIR"
"""The run folder (checkpoint.dir) of the job the supervisor runs, as it parsed it once: for
torchrun's process, which says from which checkpoint a lost group resumes."""
NNODES_ENV = "TRAINER_NNODES"
"""The job's --nnodes (N or MIN:MAX), for the workers' own check of every world size it may take."""
MOUNTS_ENV = "TRAINER_MOUNTS"
"""``dst=volume`` pairs (``;``-separated) a launcher mounted for the job (the TorchX components)."""
PR_SET_PDEATHSIG = 1


def stamp_command_start() -> None:
    """Note when the command started, unless a launcher further out did (slurm/steps.sh)."""
    os.environ.setdefault(COMMAND_START_ENV, repr(time.time()))


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; a no-op
    elsewhere). Called in torchrun's workers and, through ``preexec_fn``, in torchrun."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def supervised() -> bool:
    """True in a worker that the supervisor started (it reports errors for the workers)."""
    return bool(os.environ.get(EXIT_DIR_ENV))


def record_exit(code: int, message: str = "") -> None:
    """A worker's exit code and its error line, for the supervisor (no-op outside it)."""
    if not (folder := os.environ.get(EXIT_DIR_ENV)):
        return
    # one group of workers: torchrun's restart count, and the store port of its rendezvous round (a
    # re-form of an elastic group keeps the count; each round's store is new)
    get = os.environ.get
    name = f"{get('TORCHELASTIC_RESTART_COUNT', '0')}.{get('MASTER_PORT', '0')}-{get('RANK', '0')}"
    try:
        with replacing(Path(folder) / name) as tmp:
            tmp.write_text(f"{code}\n{message}")
    except OSError:
        pass


def record_start() -> None:
    record_exit(EXIT_RUNNING)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
"""What stops a worker with a checkpoint (trainer/worker/stop.py); during its start-up, at once."""


def stop_while_starting() -> None:
    """Until the run's StopFlag takes the stop signals over (its first step is near), one ends the
    worker at once: it has trained nothing since the newest checkpoint, so there is nothing to save
    and nothing is lost. A preemption or a time limit that comes while the workers still import
    torch, restore or compile is then a stop (exit 75, resume me), not a crash that no launcher
    retries (Slurm requeues a job after 75 only). The handler ends the process itself: an exception
    raised from it lands wherever the worker is, and inside torch's import a C function turned one
    into a TypeError."""

    def on_signal(signum, frame):
        os._exit(stopped_while_starting(signal.Signals(signum).name))

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)


def stopped_while_starting(signal_name: str) -> int:
    """The worker's end after :func:`stop_while_starting`'s signal: one line per node, the exit
    recorded for the supervisor; returns EXIT_PREEMPTED. Written straight to the file descriptor:
    the signal may have come in the middle of a print to the same stream."""
    import socket

    line = (
        f"rank {os.environ.get('RANK', '0')} ({socket.gethostname()}) stopped by {signal_name} while starting, before "
        f"its first "
        f"step: nothing to save; exit {EXIT_PREEMPTED}, the next start resumes from the newest checkpoint"
    )
    if os.environ.get("LOCAL_RANK", "0") == "0":
        os.write(2, (line + "\n").encode())
    record_exit(EXIT_PREEMPTED, line)
    return EXIT_PREEMPTED


def stopped_by_torchrun(wait_s: float = 2.0) -> bool:
    """True in a supervised worker stopped by torchrun itself (a re-form of an elastic group: a node
    joined or left), not by a signal to the job. Slurm signals every process of a step at once, so a
    worker can reach this before the supervisor has marked the signal: the mark is waited for up to
    ``wait_s`` (what a re-form pays, once, before its workers exit)."""
    folder = os.environ.get(EXIT_DIR_ENV)
    if not folder:
        return False
    deadline = time.monotonic() + wait_s
    while not (Path(folder) / SIGNALLED).exists():
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
    return False


def say(line: str) -> None:
    """One line on the console (stderr, where every launcher shows a process's output), at once."""
    print(line, file=sys.stderr, flush=True)


def warn(line: str) -> None:
    """A warning as one console line. Python's warnings module would print its source line under
    it and a category name a user cannot act on."""
    say("warning: " + one_line(line, 1000))


def one_line(text: str, limit: int = 300) -> str:
    """An error's text squeezed onto one console line: whitespace runs made one space, cut at ``limit``."""
    return " ".join(str(text).split())[:limit]
