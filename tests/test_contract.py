"""The exit contract's worker side (trainer/contract.py): what a stopped worker tells apart."""

import threading

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
