"""A worker's signals: SIGTERM, SIGUSR1, SIGINT and SIGHUP stop it after a step that every rank
agrees on, with a checkpoint of that step (exit 75: trainer/contract.py); a second SIGINT stops at
once. (The launcher's signals: trainer/launch/supervisor.py; torchrun's: trainer/launch/torchrun.py; a Slurm
batch script's: slurm/steps.sh.)

Preemption reaches a worker as SIGTERM (Kubernetes eviction, ``docker stop``, ``scancel``; the
supervisor passes SIGTERM, SIGINT and SIGHUP to torchrun, which passes them to its workers, and
turns SIGUSR1, Slurm's warning before the time limit that slurm/steps.sh passes on, into
SIGTERM). A worker that gets any of STOP_SIGNALS itself stops the same way. The handler raises a
flag (rank 0 also says so at once). At every step boundary the ranks agree on the flags with one
tiny all-reduce, so every rank stops after the *same* step and rank 0 saves a checkpoint of
exactly that step. On CUDA the all-reduce result is read ``lag`` steps later, when it has long
finished, so the agreement never makes the host wait for the GPU.
"""

from __future__ import annotations

import signal
from collections import deque

import torch
import torch.distributed as dist

from trainer.contract import STOP_SIGNALS, supervised
from trainer.worker.runtime import Runtime


class StopFlag:
    """Signal flag plus a collective agreement on the step at which all ranks stop."""

    def __init__(self, rt: Runtime, lag: int = 2):
        self.rt, self.signal_name = rt, None
        self.lag = lag if rt.cuda and rt.collectives else 0
        self._pending: deque = deque()
        for sig in STOP_SIGNALS:
            try:
                signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (e.g. inside a test harness thread)
                pass
        if rt.collectives:
            self._flag = torch.zeros(1, dtype=torch.int32, device=rt.device)
        if self.lag:  # a ring of pinned results and their events, reused every lag+1 steps
            self._ring = [
                (torch.zeros(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event()) for _ in range(lag + 1)
            ]
            self._next = 0

    def _on_signal(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        first = self.signal_name is None
        self.signal_name = signal.Signals(signum).name
        # at once, not when the step ends; under the supervisor it says so itself, and a signal it
        # did not pass on is torchrun re-forming the group, which it reports in its own words
        if first and self.rt.is_main and not supervised():
            print(
                f"{self.signal_name} received: stopping after the current step and saving a checkpoint (Ctrl-C again "
                f"stops at once)",
                flush=True,
            )

    @property
    def raised(self) -> bool:
        return self.signal_name is not None

    def poll(self) -> bool:
        """Call once per step on every rank: True on all ranks at the same step once any rank
        has been signalled."""
        if not self.rt.collectives:
            return self.raised
        self._flag.fill_(1 if self.raised else 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        if self.lag == 0:
            return bool(self._flag.item())
        host, done = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        host.copy_(self._flag, non_blocking=True)
        done.record()
        self._pending.append((host, done))
        if len(self._pending) <= self.lag:
            return False
        host, done = self._pending.popleft()
        done.synchronize()  # finished `lag` steps ago: no real wait
        return bool(host.item())
