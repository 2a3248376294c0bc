"""What the supervisor does for a Slurm job whose batch script does not look after it.

slurm/ddp.sh asks Slurm for USR1 before the time limit, requeues the job after a save, never after
bad input, and passes ``--cpus-per-task`` to srun. TorchX's sbatch script (torchx 0.7) does none of
this: it asks for no warning, requeues on any non-zero exit while ``--max_retries`` allows (exit 2
included), and its srun runs without ``-c``. The TorchX components therefore set
``TRAINER_SLURM_SUPERVISE=1``, and in a Slurm job the supervisor then

- stops the workers ``TRAINER_SLURM_MARGIN_S`` (120) seconds before the job's time limit, as a
  signal would: they save and exit 75;
- requeues the job after such a save, or after a preemption's (the job's PreemptTime is set), from
  whichever node's task gets there first: the requeued job resumes from that checkpoint;
- after bad input (exit 2) makes the job not requeueable, so no retry runs the same input again.

In every Slurm job step (with or without that variable): a step confined to fewer CPUs than the job
holds per task says so in one line with the fix (since Slurm 22.05 srun does not inherit
``--cpus-per-task``; the workers and their data threads would share one CPU).

Nothing here imports torch; outside Slurm nothing here runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

from trainer.contract import EXIT_PREEMPTED, EXIT_USAGE, say

SUPERVISE_ENV = "TRAINER_SLURM_SUPERVISE"
MARGIN_ENV = "TRAINER_SLURM_MARGIN_S"
DEFAULT_MARGIN_S = 120.0
"""Seconds before the time limit to stop: the current step, the save and the requeue must fit (the
same margin as slurm/ddp.sh's ``--signal=B:USR1@120``)."""


def _job() -> str:
    """The job to ask about and act on: a heterogeneous job's leader (TorchX submits a multi-node
    job as one, a component per node; the leader's requeue requeues them all), else the job."""
    return os.environ.get("SLURM_HET_JOB_ID") or os.environ.get("SLURM_JOB_ID", "")


def supervising() -> bool:
    """Whether this process looks after its Slurm job (see the module docstring)."""
    return os.environ.get(SUPERVISE_ENV) == "1" and bool(_job())


def margin_problem() -> str | None:
    """The one-line error for a margin that is no number of seconds, else None."""
    value = os.environ.get(MARGIN_ENV, "")
    try:
        if not value or float(value) >= 0:
            return None
    except ValueError:
        pass
    return (
        f"error: {MARGIN_ENV}={value!r} is not a number of seconds: set it to the seconds to stop before the time "
        f"limit (default {DEFAULT_MARGIN_S:.0f})"
    )


def _slurm(*cmd: str) -> str | None:
    """A Slurm client's output, or None where it failed (or is missing)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def parse_time_left(text: str) -> float | None:
    """squeue's ``%L`` ([days-][hours:]minutes:seconds) in seconds, the least of its lines (a
    heterogeneous job prints one per component); None where no line is a time (UNLIMITED, NOT_SET)."""
    left = []
    for line in text.split():
        if m := re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", line):
            days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
            left.append(float(((days * 24 + hours) * 60 + minutes) * 60 + seconds))
    return min(left) if left else None


class TimeLimit:
    """Says once when the job is within the margin of its time limit (asked of squeue at the start:
    a requeued job starts with its whole limit again)."""

    def __init__(self) -> None:
        self.margin_s = float(os.environ.get(MARGIN_ENV) or DEFAULT_MARGIN_S)
        left = parse_time_left(_slurm("squeue", "-h", "-j", _job(), "-o", "%L") or "")
        self.at: float | None = None
        self.reached = False
        if left is not None and left <= self.margin_s:
            say(
                f"slurm: job {_job()} has {left:.0f} s left, within the {self.margin_s:.0f} s margin ({MARGIN_ENV}): "
                "it will not stop to save before its time limit"
            )
        elif left is not None:
            self.at = time.monotonic() + left - self.margin_s

    def check(self) -> str:
        """'' until the margin is reached; then, once, the line to say before stopping the workers."""
        if self.at is None or self.reached or time.monotonic() < self.at:
            return ""
        self.reached = True
        return (
            f"slurm: job {_job()} reaches its time limit in {self.margin_s:.0f} s: the workers stop after their "
            f"current step "
            "and save a checkpoint, then the job is requeued"
        )


def preempted() -> bool:
    """Whether Slurm preempted the job (it stamps PreemptTime; PreemptMode=REQUEUE signals only the
    steps, and a job that ends within its grace time would end FAILED, not requeued)."""
    out = _slurm("scontrol", "show", "job", _job())
    return bool(out and re.search(r"\bPreemptTime=\d", out))


def after(code: int, limit: TimeLimit | None) -> None:
    """The job's fate after the supervisor's exit code: requeued after a save for its time limit or a
    preemption, never after bad input. Every node's task asks, before it exits: the workers leave
    only once the checkpoint is on disk, and TorchX's ``srun --kill-on-bad-exit=1`` kills the other
    tasks as soon as one exits 75, so the first task may never get to ask. The first request
    requeues the job (and ends every step); a later one finds it requeued and says nothing."""
    job = _job()
    if code == EXIT_USAGE:
        if _slurm("scontrol", "update", f"JobId={job}", "Requeue=0") is not None:
            say(f"slurm: job {job} had bad input: it is no longer requeueable (fix the input and submit again)")
        return
    if code != EXIT_PREEMPTED or not ((limit is not None and limit.reached) or preempted()):
        return
    say(f"slurm: requeueing job {job}; it resumes from the checkpoint just saved")
    if _slurm("scontrol", "requeue", job) is None and not requeued(job):
        say(f"slurm: job {job} could not be requeued (cancelled?): it stays stopped, exit 75")


def requeued(job: str) -> bool:
    """Whether another task's request requeued the job already (it is pending again, or on its way)."""
    out = _slurm("scontrol", "show", "job", job)
    return bool(out and re.search(r"\bJobState=(PENDING|REQUEUED|REQUEUE_HOLD|REQUEUE_FED|COMPLETING)\b", out))


def cpu_shortfall() -> str:
    """'' unless this Slurm job step runs on fewer CPUs than the job holds per task: then the line
    that says so and how to fix it."""
    want, step = os.environ.get("SLURM_CPUS_PER_TASK", ""), os.environ.get("SLURM_STEP_ID")
    if step is None or not want.isdigit() or not hasattr(os, "sched_getaffinity"):
        return ""
    have = len(os.sched_getaffinity(0))
    if have >= int(want):
        return ""
    return (
        f"slurm: warning: this job step runs on {have} CPU(s) of the {want} per task the job holds (srun has not "
        f"passed "
        f"--cpus-per-task on since Slurm 22.05): export SRUN_CPUS_PER_TASK={want} before sbatch or torchx run, or "
        f"srun -c {want}"
    )
