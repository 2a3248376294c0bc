"""torchrun itself, as the supervisor runs it (``python -m trainer.launch.torchrun ARGS``, never by hand):
torchrun's own main with a thread that says what its rendezvous waits for (trainer/launch/rendezvous.py),
minus the traceback it prints when a signal stops it or its rendezvous cannot form. The workers
report what they did; the supervisor turns it into the exit code.

Signals: torchrun's own handlers take SIGTERM, SIGINT and SIGHUP (the supervisor passes each on
once; SIGUSR1 comes as SIGTERM) and forward them to every worker; it then exits 128 + the signal.
torch installs them only when it starts workers: before that (at the rendezvous) the same handlers
are installed here, so that a stop there is said, not a silent death by the signal. Their
exception can come inside a logging call, which would print "--- Logging error ---" and 60 lines
of stack and swallow the stop: :func:`signals_through_logging` lets it through.
"""

from __future__ import annotations

import signal
import sys

from trainer.contract import EXIT_CRASH, say
from trainer.launch.rendezvous import Reporter
from trainer.launch.torchrun_args import rendezvous_failure

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def signals_through_logging() -> None:
    """A stop raised inside a logging call (torch's handler raises SignalException wherever the main
    thread is) goes on up, as it would anywhere else, instead of logging's error page."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException

    plain = logging.Handler.handleError

    def handle_error(handler, record):
        if isinstance(sys.exc_info()[1], SignalException):
            raise  # noqa: PLE0704 - re-raises the exception being handled by logging's emit
        plain(handler, record)

    logging.Handler.handleError = handle_error


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun_main

    signals_through_logging()
    for s in STOPS:  # torch's own handler, before torch installs it with its first workers
        signal.signal(s, _terminate_process_handler)
    reporter = Reporter.for_args(argv)
    if reporter is not None:
        reporter.start()  # says what the rendezvous waits for, while it waits
    try:
        torchrun_main(argv)
    except SignalException as e:
        say(f"torchrun: stopped on {signal.Signals(e.sigval).name}")
        return 128 + int(e.sigval)
    except RendezvousError as e:  # a crash (another node may yet come): the launcher's retry is right
        say(rendezvous_failure(argv, e, reporter.left if reporter else None))
        return EXIT_CRASH
    except ChildFailedError as e:  # the workers said what failed, each in one line; torchrun's box repeats it
        rank, failure = e.get_first_failure()
        say(
            f"torchrun: no restart left after rank {rank} exited {failure.exitcode} (pid {failure.pid}); the workers' "
            f"lines above "
            "say what failed, their tracebacks are in the run folder (error-rank*.txt)"
        )
        return failure.exitcode if failure.exitcode > 0 else EXIT_CRASH
    finally:
        if reporter is not None:
            reporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
