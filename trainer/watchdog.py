"""The hang watchdog: a run that stops making progress ends as a crash, with its stacks saved, so
the launcher restarts it from the newest checkpoint instead of holding the GPUs forever.

A collective timeout (dist.timeout_s) catches a rank that stops answering only while the others
wait in a collective, and never a job of one process. This catches the rest: a data read, a
checkpoint write or a file system that blocks, a deadlock, a process that was stopped.

Progress is a finished training step, evaluation batch or checkpoint save (``beat()``: two clock
reads, no sync). The bound is ``dist.hang_timeout_s``, raised to 10x the longest pause between two
beats seen so far, so a run whose steps or saves are slow by nature is never cut short. It is
armed by the first beat (after compilation and the first step), and watched in three places:

1. a thread in each worker (every second): past the bound it appends every thread's Python stack
   to ``<run folder>/hang-rank<R>.txt``, says so in one line and exits with EXIT_HUNG (124, as
   timeout(1) does); torchrun restarts the group, the scheduler the job;
2. faulthandler's own C thread, re-armed by that thread every second: if a C call holds the GIL so
   that the Python thread cannot run, it prints the stacks to stderr and exits 1 a little later;
3. the supervisor (``trainer torchrun``, trainer/supervisor.py), for a process that cannot act at all
   (SIGSTOP, a debugger, a frozen container): the thread keeps ``$TRAINER_EXIT_DIR/hb-<rank>``
   fresh while the run progresses; a file older than the bound plus HEARTBEAT_MARGIN_S gets its
   worker killed, and a note of its process state in the same hang file.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

from trainer.supervisor import EXIT_DIR_ENV, EXIT_HUNG

GROWTH = 10
"""The bound is at least this many times the longest pause between two beats seen so far."""
TICK_S = 1.0


class Watchdog:
    def __init__(self, bound_s: float, root: Path, rank: int):
        self.bound_s, self.root, self.rank = float(bound_s), Path(root), rank
        self.last: float | None = None
        self.slowest = 0.0
        self.step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        folder = os.environ.get(EXIT_DIR_ENV)
        self._heartbeat = Path(folder) / f"hb-{rank}" if folder else None

    @property
    def enabled(self) -> bool:
        return self.bound_s > 0

    def bound(self) -> float:
        return max(self.bound_s, GROWTH * self.slowest)

    def beat(self, step: int | None = None) -> None:
        """Progress. The first call arms the watchdog."""
        now = time.monotonic()
        if step is not None:
            self.step = step
        if self.last is not None and now - self.last > self.slowest:
            self.slowest = now - self.last
        first, self.last = self.last is None, now
        if first and self.enabled:
            self._write_heartbeat(self.bound_s)
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Disarm (the run ends): nothing fires after this."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        faulthandler.cancel_dump_traceback_later()
        if self._heartbeat is not None:
            self._heartbeat.unlink(missing_ok=True)

    # ---------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(TICK_S):
            idle, bound = time.monotonic() - self.last, self.bound()
            if idle > bound:
                self._fire(idle, bound)
                return
            # the backstop, in case this thread cannot run again (a C call holding the GIL)
            faulthandler.dump_traceback_later(bound - idle + 5 * TICK_S, exit=True)
            self._write_heartbeat(bound)

    def _write_heartbeat(self, bound: float) -> None:
        if self._heartbeat is None:
            return
        tmp = self._heartbeat.with_name(f".{self._heartbeat.name}.tmp")
        try:
            tmp.write_text(json.dumps({"pid": os.getpid(), "rank": self.rank, "step": self.step, "bound_s": bound,
                                       "hang_file": str(self.hang_file)}))
            tmp.replace(self._heartbeat)
        except OSError:
            pass

    @property
    def hang_file(self) -> Path:
        return self.root / f"hang-rank{self.rank}.txt"

    def _fire(self, idle: float, bound: float) -> None:
        faulthandler.cancel_dump_traceback_later()
        where = self.hang_file
        try:
            with open(where, "a") as f:
                f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} rank {self.rank} pid {os.getpid()}: no progress for {idle:.0f} s "
                        f"after step {self.step} (bound {bound:.0f} s); Python stacks of every thread:\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError:
            where = "stderr (the run folder is not writable)"
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        print(f"rank {self.rank}: no training progress for {idle:.0f} s after step {self.step} (dist.hang_timeout_s, "
              f"bound {bound:.0f} s): stacks in {where}; exiting {EXIT_HUNG} so that the launcher restarts from the newest checkpoint",
              file=sys.stderr, flush=True)
        os._exit(EXIT_HUNG)  # the main thread is stuck: no cleanup can be trusted to finish
