"""torchrun as the supervisor runs it (trainer/launch/torchrun.py): the signals it takes."""

import subprocess
import sys

from conftest import ROOT

RAISED_IN_LOGGING = r"""
import logging, os, signal, sys
from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
from trainer.launch.torchrun import signals_through_logging
if sys.argv[1] == "fixed":
    signals_through_logging()
signal.signal(signal.SIGTERM, _terminate_process_handler)

class Slow(logging.StreamHandler):
    def emit(self, record):  # the signal lands while a record is written, as torch's agent logs
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            super().emit(record)
        except Exception:
            self.handleError(record)

log = logging.getLogger("agent")
log.addHandler(Slow())
try:
    log.warning("starting workers")
    print("the stop was lost")
except SignalException:
    print("stopped")
"""


def test_a_stop_that_lands_inside_a_log_call_stops_and_prints_no_logging_error():
    """torch's handler raises where the main thread is; inside logging's emit, logging printed its
    '--- Logging error ---' page (60-odd lines of stack into the Slurm output) and the stop was lost."""
    before = subprocess.run(
        [sys.executable, "-c", RAISED_IN_LOGGING, "plain"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert "the stop was lost" in before.stdout and "--- Logging error ---" in before.stderr  # what torch alone does
    after = subprocess.run(
        [sys.executable, "-c", RAISED_IN_LOGGING, "fixed"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert after.stdout.strip() == "stopped" and "Logging error" not in after.stderr, after.stdout + after.stderr
