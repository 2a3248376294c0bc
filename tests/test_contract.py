"""The exit contract's worker side (trainer/contract.py): what a stopped worker tells apart."""

import signal
import threading
import time

import pytest
from conftest import TINY, env, spawn, trainer_cmd

from trainer import contract


def test_a_signal_marked_late_is_still_a_signal_and_no_mark_is_a_re_form(tmp_path, monkeypatch):
    """Slurm signals the workers and the supervisor at once: a worker that saved before the
    supervisor marked the signal waits for the mark rather than calling the stop a re-form."""
    monkeypatch.setenv(contract.EXIT_DIR_ENV, str(tmp_path))
    assert contract.stopped_by_torchrun(wait_s=0.2)  # torchrun stopped the group: no mark comes
    late = threading.Timer(0.3, (tmp_path / contract.SIGNALLED).touch)
    late.start()
    try:
        assert not contract.stopped_by_torchrun(wait_s=10.0)  # the mark came: a signal to the job
    finally:
        late.cancel()
    monkeypatch.delenv(contract.EXIT_DIR_ENV)
    assert not contract.stopped_by_torchrun()  # a worker nobody supervises


@pytest.mark.parametrize("after_s", [0.3, 0.8, 1.5, 2.5])
def test_a_stop_at_any_moment_of_a_workers_start_is_exit_75_and_one_line(tmp_path, after_s):
    """A stop while the worker imports torch, builds or restores: exit 75 and its one line, never a
    traceback (a handler that raised landed inside torch's import as a TypeError, a crash)."""
    worker = spawn([*trainer_cmd("train"), *TINY, "train.epochs=50", f"checkpoint.dir={tmp_path}"], env())
    time.sleep(after_s)
    worker.send_signal(signal.SIGTERM)
    out = worker.communicate(timeout=120)[0]
    assert worker.returncode == contract.EXIT_PREEMPTED, out
    if "step 1/" in out or "epoch 1/" in out:  # this machine started faster than the delay: the run's own stop
        return
    assert "stopped by SIGTERM while starting, before its first step: nothing to save; exit 75" in out, out
    assert "Traceback" not in out, out
