"""Fault injection for the tests: crash points in the training loop and the checkpoint writer,
off unless TRAINER_FAULT names one. The standard library only; a test sets the variables, the
trainer never does."""

from __future__ import annotations

import functools
import os
import signal
import time


def crash_point(name: str, step: int | None = None) -> None:
    """Fault injection for the tests, off unless TRAINER_FAULT names this point.

    TRAINER_FAULT="POINT[@STEP]:ACTION" with ACTION ``kill`` (SIGKILL this process),
    ``sleep=SECONDS`` (a read or write that blocks) or ``slow=SECONDS`` (every time, a straggler).
    Points: ``batch`` (before a training step reads its batch) and ``before-rename`` (a checkpoint
    written, not yet published). It acts on rank TRAINER_FAULT_RANK (default 0) and, but for
    ``slow``, only on the first attempt (torchrun's TORCHELASTIC_RESTART_COUNT=0), so a restarted
    group runs through.
    """
    fault = _fault()
    if fault is None:
        return
    point, at, action = fault
    if point != name or (at is not None and step is not None and at != step):
        return
    if os.environ.get("RANK", "0") != os.environ.get("TRAINER_FAULT_RANK", "0"):
        return
    if action.startswith("slow="):
        time.sleep(float(action.split("=", 1)[1]))
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if action.startswith("sleep="):
        time.sleep(float(action.split("=", 1)[1]))
        return
    os.kill(os.getpid(), signal.SIGKILL)


@functools.cache
def _fault() -> tuple[str, int | None, str] | None:
    """TRAINER_FAULT parsed once (crash_point runs every step)."""
    if not (spec := os.environ.get("TRAINER_FAULT")):
        return None
    where, _, action = spec.partition(":")
    point, _, at = where.partition("@")
    return point, int(at) if at else None, action


def trace_samples(epoch: int, step: int, rank: int, idx) -> None:
    """TRAINER_SAMPLE_TRACE=FOLDER (tests): each rank appends 'epoch step id id ...' of every step
    it trains to FOLDER/samples-rankR.txt, so a test can check that a resumed or re-formed run
    sees every image of an epoch exactly once."""
    folder = os.environ.get("TRAINER_SAMPLE_TRACE")
    if folder:
        with open(os.path.join(folder, f"samples-rank{rank}.txt"), "a") as fh:
            fh.write(f"{epoch} {step} {' '.join(str(int(i)) for i in idx.tolist())}\n")


class StepHooks:
    """The tests' hooks on the training step (a fault before a batch is read, the trace of the
    samples each step trains), built only where their variable is set: the step of a run without
    them calls nothing."""

    def __init__(self, rank: int, fault: bool, trace: str):
        self.rank, self.fault, self.trace = rank, fault, trace

    def before_read(self, step: int) -> None:
        if self.fault:
            crash_point("batch", step)

    def after_read(self, epoch: int, epoch_step: int, idx) -> None:
        if self.trace:
            trace_samples(epoch, epoch_step, self.rank, idx)


def step_hooks(rank: int) -> StepHooks | None:
    """The step's test hooks: None unless TRAINER_FAULT names the ``batch`` point or TRAINER_SAMPLE_TRACE is set."""
    fault = (_fault() or ("",))[0] == "batch"
    trace = os.environ.get("TRAINER_SAMPLE_TRACE", "")
    return StepHooks(rank, fault, trace) if fault or trace else None
