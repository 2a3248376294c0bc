"""The console holds the project's lines; torch's native ones go to a file in the run folder.

torchrun and its workers share the supervisor's stderr. Besides the project's one-line reports,
torch writes there from C++ and from its logging: c10d's ``[W1206 08:23:49.1 socket.cpp:...]``
lines (with a ``[rank1]:`` prefix in a worker), the backtraces of a native exception
(``Exception raised from ...``, ``frame #0: ...``), and torchrun's own ``W1206 ... run.py:982]`` /
``E1206 ... api.py:...] failed (exitcode: -9)`` lines, also after a stop the supervisor made on
purpose. When the peer that holds the workers' store is lost, each survivor printed 12-39 such
lines before the project's one. :class:`Relay` copies the stream line by line: a native line (and
the backtrace lines that follow it) goes to ``RUN/native-stderr.txt``, everything else to the
console unchanged.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import BinaryIO

NATIVE = re.compile(
    rb"^(\[rank\d+\]:)?\[?[WEIF]\d{4} \d\d:\d\d:\d\d\.\d+ +\S|^\[c10d\] "
    rb"|^Exception raised from |^frame #\d+: |^terminate called "
)
"""A line that opens native output: a glog-style or torch-logging line, a c10d report, a C++ backtrace."""
CONTINUED = re.compile(
    rb"^(frame #\d+: |Exception raised from |\(no backtrace available\)|<omitting python frames>|\s*$)"
)
"""Lines that go on a native block: more backtrace, or blank."""


class Relay:
    """Copies ``source`` (torchrun's stderr) to ``console``, native lines to ``native`` (a path,
    opened on the first such line) instead; in a thread of its own until the stream ends."""

    def __init__(self, source: BinaryIO, native: Path, console: BinaryIO | None = None):
        self.source, self.native, self.console = source, native, console or sys.stderr.buffer
        self.diverted = 0
        self._thread = threading.Thread(target=self._run, name="native-stderr", daemon=True)

    def start(self) -> Relay:
        self._thread.start()
        return self

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        out, in_block = None, False
        try:
            for line in iter(self.source.readline, b""):
                in_block = bool(NATIVE.match(line)) or (in_block and bool(CONTINUED.match(line)))
                if not in_block:
                    self._show(line)
                    continue
                if out is None:
                    out = self._open()
                if out is not None:
                    out.write(line)
                    out.flush()
                self.diverted += 1
        finally:
            if out is not None:
                out.close()

    def _show(self, line: bytes) -> None:
        """To the console; a console that is gone (a closed pipe) is not written again, but the
        stream is still read to its end: a full pipe would block every writer, the workers too."""
        if self.console is None:
            return
        try:
            self.console.write(line)
            self.console.flush()
        except (OSError, ValueError):
            self.console = None

    def _open(self):
        try:
            self.native.parent.mkdir(parents=True, exist_ok=True)
            return open(self.native, "ab")
        except OSError:  # a folder we cannot write: the lines are dropped, never the console's
            return None
