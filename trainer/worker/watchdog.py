"""The hang watchdog: a run that stops making progress ends as a crash, with its stacks saved, so
the launcher restarts it from the newest checkpoint instead of holding the GPUs forever.

A collective timeout (dist.timeout_s) catches a rank that stops answering only while the others
wait in a collective, and never a job of one process. This catches the rest: a data read, a
checkpoint write or a file system that blocks, a deadlock, a process that was stopped.

Progress is a finished training step, evaluation batch or checkpoint save (``beat()``: two clock
reads, no sync). The bound is ``dist.hang_timeout_s``, raised to 10x the longest ordinary pause
between two beats, so a run whose steps or saves are slow by nature is never cut short. A pause
that the run recovered from (a link cut ridden out, a slow read: more than STALL times the median
of the recent pauses of its kind, a step's or a save's) is a stall, not the run's nature: it
raises nothing, and the progress lines leave its time out, wherever in the step or the save it
fell. With other ranks, the bound stays below ``dist.timeout_s`` (CEILING of it) however slow the
steps and whatever ``dist.hang_timeout_s`` says, so a hang outside a collective leaves stacks
before the collective timeout. It is armed by the first beat
(after compilation and the first step), and watched in three places:

1. a thread in each worker (every second): past the bound it appends every thread's Python stack
   to ``<run folder>/hang-rank<R>.txt``, says so in one line and exits with EXIT_HUNG (124, as
   timeout(1) does); torchrun restarts the group, the scheduler the job;
2. faulthandler's own C thread, re-armed by that thread every second: if a C call holds the GIL so
   that the Python thread cannot run, it prints the stacks to stderr and exits 1 a little later;
3. the supervisor (``trainer torchrun``, trainer/launch/supervisor.py), for a process that cannot act at all
   (SIGSTOP, a debugger, a frozen container): the thread keeps ``$TRAINER_EXIT_DIR/hb-<rank>``
   fresh while the run progresses; a file older than the bound plus HEARTBEAT_MARGIN_S gets its
   worker killed, and a note of its process state in the same hang file.

Whom a rank waited for: with other ranks, a second thread (Peers.follow) publishes the rank's
host, step and phase (data, step, eval, save) to the job's store every PUBLISH_S (its own
connection, with a short timeout; a store call that blocks delays that thread, never the
watchdog's). Once a rank's progress is past a third of its bound it reads the others' records,
so the line it prints when it fires names the rank that stopped: one whose record no longer moves
(stopped, frozen, or its host lost), one blocked
in its data read, or a store that no longer answers (rank 0's host).
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

from trainer.contract import EXIT_DIR_ENV, EXIT_HUNG, record_exit, say
from trainer.files import replacing
from trainer.runfolder import heartbeat_file, step_file

GROWTH = 10
"""The bound is at least this many times the longest ordinary pause between two beats."""
STALL = 5
"""A pause longer than this many times the median of the recent pauses is a stall, not the run's pace."""
STALL_MIN_S = 1.0
"""...and longer than this: the training thread of a GPU run launches steps ahead and waits on the
queue now and then (1 ms pauses, then 50 ms), which is its pace, not a stall (the progress lines
left those waits out and read 30,000 images/s for 5,500)."""
HISTORY = 64
"""Recent pauses the median is taken over."""
CEILING = 0.9
"""The bound never exceeds this fraction of dist.timeout_s (nor goes below dist.hang_timeout_s)."""
TICK_S = 1.0
PUBLISH_S = 2.0
"""How often each rank's record goes to the job's store (a few bytes: one store write)."""
STORE_TIMEOUT_S = 5.0
NOTE_WAIT_S = 3.0
"""How long a rank that lost a connection waits for the others' notes before naming the silent ones."""


class Watchdog:
    KINDS = ("step", "save", "eval")
    """What a beat ends: its pauses are compared with the recent pauses of the same kind."""

    def __init__(
        self, bound_s: float, root: Path, rank: int, timeout_s: float = 0.0, world_size: int = 1, group: str = ""
    ):
        self.bound_s, self.root, self.rank = float(bound_s), Path(root), rank
        # with other ranks, below their collective timeout (a process alone has none)
        self.ceiling_s = CEILING * timeout_s if timeout_s and world_size > 1 else float("inf")
        self.world_size = world_size
        self.last: float | None = None
        self.slowest = 0.0
        self.stalled_s = 0.0
        """Seconds of stalls between training steps so far (the progress lines leave them out)."""
        self.step = 0
        self.phase = "start"
        self._gaps: dict[str, deque[float]] = {kind: deque(maxlen=HISTORY) for kind in self.KINDS}
        self._last_kind = "start"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        folder = os.environ.get(EXIT_DIR_ENV)
        self._heartbeat = heartbeat_file(Path(folder), rank) if folder else None
        self._step_file = step_file(Path(folder), rank) if folder else None
        self._step_map = None
        """This rank's last finished step, 8 bytes of a shared mapping written at every step (a memory
        store, no system call): what the supervisor reports of a stopped worker, exactly, where the
        heartbeat file is rewritten once a second."""
        self.peers = Peers(rank, world_size, group) if world_size > 1 else None

    @classmethod
    def of(cls, cfg, rt, root: Path) -> Watchdog:
        """The watchdog of a run of ``cfg`` on runtime ``rt`` (its peers: the other ranks of its group)."""
        return cls(
            cfg.dist.hang_timeout_s, root, rt.rank, cfg.dist.timeout_s, rt.world_size if rt.collectives else 1, rt.group
        )

    @property
    def enabled(self) -> bool:
        return self.bound_s > 0

    def bound(self) -> float:
        return min(max(self.bound_s, GROWTH * self.slowest), self.ceiling_s)

    def at(self, phase: str) -> None:
        """What the main thread does now (data, step, eval, save): named when it hangs."""
        self.phase = phase

    def beat(self, step: int | None = None, kind: str = "eval") -> None:
        """Progress: training step ``step`` done, or else an evaluation batch or (kind="save") a
        checkpoint save. The first call arms the watchdog."""
        now = time.monotonic()
        kind = "step" if step is not None else kind
        if self.last is not None:
            self._pause(now - self.last, kind)
        if step is not None:
            self.step = step
            if self._step_map is not None:
                self._step_map[:8] = step.to_bytes(8, "little", signed=True)
        self._last_kind = kind
        first, self.last = self.last is None, now
        if first and self.enabled:
            self._map_step()
            self._write_heartbeat(self.bound_s)
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def _pause(self, gap: float, kind: str) -> None:
        """An ordinary pause may raise the bound; a stall (the run recovered from it) does not.
        Stalls inside the training loop (a step's pause, or a save's: a cut link blocks the log
        line's or the stop poll's collective just as well) count in ``stalled_s``; the first step
        after an evaluation is left alone, its pause holds the epoch's start."""
        gaps = self._gaps[kind]
        median = statistics.median(gaps) if len(gaps) >= 3 else None
        stall = median is not None and gap > STALL * median and gap > STALL_MIN_S
        if stall and kind in ("step", "save") and self._last_kind in ("step", "save"):
            self.stalled_s += gap - median
        gaps.append(gap)
        if not stall and gap > self.slowest:
            self.slowest = gap

    def close(self) -> None:
        """Disarm (the run ends): nothing fires after this."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        faulthandler.cancel_dump_traceback_later()
        if self._heartbeat is not None:
            self._heartbeat.unlink(missing_ok=True)
        if self._step_map is not None:
            self._step_map.close()
            self._step_map = None
            self._step_file.unlink(missing_ok=True)

    def _map_step(self) -> None:
        if self._step_file is None:
            return
        import mmap

        try:
            with open(self._step_file, "wb+") as f:
                f.write(self.step.to_bytes(8, "little", signed=True))
                f.flush()
                self._step_map = mmap.mmap(f.fileno(), 8)
        except OSError:
            self._step_map = None

    # ---------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        if self.peers is not None:  # its store I/O on a thread of its own: a cut link never delays this one
            threading.Thread(target=self.peers.follow, args=(self,), name="hang-watchdog-peers", daemon=True).start()
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
        try:
            with replacing(self._heartbeat) as tmp:
                tmp.write_text(
                    json.dumps(
                        {
                            "pid": os.getpid(),
                            "rank": self.rank,
                            "step": self.step,
                            "bound_s": bound,
                            "hang_file": str(self.hang_file),
                        }
                    )
                )
        except OSError:
            pass

    @property
    def hang_file(self) -> Path:
        return self.root / f"hang-rank{self.rank}.txt"

    def culprit(self) -> str:
        """Whom this rank waits for, as a clause of the hang line ('' when it cannot tell)."""
        if self.phase == "data":
            return "; it is blocked in its own data read"
        return self.peers.culprit(self.step) if self.peers is not None else ""

    def _fire(self, idle: float, bound: float) -> None:
        faulthandler.cancel_dump_traceback_later()
        where, whom = self.hang_file, self.culprit()
        try:
            with open(where, "a") as f:
                f.write(
                    f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} rank {self.rank} ({socket.gethostname()}) pid "
                    f"{os.getpid()}: "
                    f"no progress for {idle:.0f} s after step {self.step} in phase {self.phase} (bound {bound:.0f} "
                    f"s){whom}; "
                    "Python stacks of every thread:\n"
                )
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError:
            where = "stderr (the run folder is not writable)"
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        line = (
            f"rank {self.rank} ({socket.gethostname()}): no training progress for {idle:.0f} s after step {self.step} "
            f"(dist.hang_timeout_s, bound {bound:.0f} s){whom}; stacks in "
            f"{where}{flight_record(self.root, self.rank, dump=True)}; "
            f"exiting {EXIT_HUNG} so that the launcher "
            "restarts from the newest checkpoint"
        )
        say(line)
        record_exit(EXIT_HUNG, line)  # for the supervisor: where the job was when a node is not back
        os._exit(EXIT_HUNG)  # the main thread is stuck: no cleanup can be trusted to finish


FLIGHT_RECORD = "nccl-trace-rank"
"""NCCL's flight recorder (the last 2000 collectives of each rank, on by default) dumps to
``<run folder>/nccl-trace-rank<R>``: on a collective timeout (trainer/worker/runtime.py points it
there), and when the hang watchdog fires. ``torchfrtrace`` reads the files of every rank together."""
_STARTED = time.time()


def flight_record(root: Path, rank: int, dump: bool = False) -> str:
    """'; NCCL flight record in PATH' when this process wrote one (``dump``: write it now), else ''."""
    path = root / f"{FLIGHT_RECORD}{rank}"
    if dump and "torch" in sys.modules:
        try:
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_backend() == "nccl":
                from torch._C._distributed_c10d import _dump_nccl_trace  # no public call dumps on demand (torch 2.11)

                with replacing(path) as tmp:
                    tmp.write_bytes(_dump_nccl_trace())
        except Exception:  # noqa: BLE001 - the stacks are written already; a missing record must not hide them
            pass
    try:
        return f"; NCCL flight record in {path}" if path.stat().st_mtime >= _STARTED else ""
    except OSError:
        return ""


class Peers:
    """Each rank's last record in the job's store, and what they say about a hang.

    A connection of its own to the store torchrun's workers share (MASTER_ADDR:MASTER_PORT, hosted
    by rank 0's process), with a short timeout: the training's own connection may be blocked."""

    def __init__(self, rank: int, world_size: int, group: str = ""):
        self.rank, self.world_size, self.host = rank, world_size, socket.gethostname()
        self._store = None
        # this group's ranks only. Not torchrun's restart count: a node that joined later counts
        # from 0 while the others count on, so the ranks of one group wrote under different keys and
        # a live rank read as one that "never reported". torchrun's shared c10d store outlives the group.
        self._prefix = f"trainer/watchdog/{group or os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._seq = 0
        self._seen: dict[int, tuple[int, float, dict]] = {}
        """rank -> (its record's seq when first seen so, when that was, the record)."""
        self._since: float | None = None
        self._read = False
        """Whether a read of every record has ended since this rank began to look."""
        self.unreachable = ""

    def _connect(self):
        """The connection; made again after a call failed (a connection whose call timed out may
        read the late answer to it as the next one's), each time after a plain connect succeeds:
        torch's own connect retries print pages of C++ frames when nobody answers."""
        if self._store is None:
            import torch.distributed as dist

            socket.create_connection(
                (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=STORE_TIMEOUT_S
            ).close()

            self._store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=STORE_TIMEOUT_S),
                wait_for_workers=False,
            )
        return self._store

    def follow(self, dog: Watchdog) -> None:
        """Publish this rank's record every PUBLISH_S (at once first: a rank stopped a second later
        has one); read the others' every tick while this rank's progress is overdue (past a third
        of its bound). Store calls may block for STORE_TIMEOUT_S: this thread only lags."""
        published = 0.0
        while not dog._stop.is_set():
            if time.monotonic() - published >= PUBLISH_S:
                self.publish(dog.step, dog.phase)
                published = time.monotonic()
            if dog.last is not None and time.monotonic() - dog.last > dog.bound() / 3:
                self.observe()
            else:
                self.forget()
            dog._stop.wait(TICK_S)

    def publish(self, step: int, phase: str) -> None:
        self._seq += 1
        record = {"host": self.host, "step": step, "phase": phase, "seq": self._seq, "time": round(time.time(), 3)}
        try:
            self._connect().set(f"{self._prefix}/{self.rank}", json.dumps(record))
        except Exception as e:  # noqa: BLE001 - a store that does not answer is itself the news
            self.unreachable, self._store = f"{type(e).__name__}", None

    def note_failure(self) -> bool:
        """Say in the store that this rank failed (and lives): False when the store does not answer."""
        try:
            self._connect().set(f"{self._prefix}/failed/{self.rank}", "1")
            return True
        except Exception:  # noqa: BLE001
            return False

    def lost(self, hosts: list[tuple[str, list[str]]], wait_s: float = NOTE_WAIT_S) -> list[tuple[int, str]] | None:
        """After a lost connection: the ranks that are gone, not the ones that failed because of
        them. Every rank that fails notes it in the store (``note_failure``); the ranks with no note
        after ``wait_s`` are the lost ones. None when it cannot tell. A survivor whose worker left
        without a note (killed before it could write one) is silent too: under load the broken
        connection's peer named may then be such a survivor, not the lost rank."""
        host = lambda r: hosts[r][0] if r < len(hosts) else "?"  # noqa: E731
        if not self.note_failure():  # the store is in rank 0's process: its host is the one lost
            return [(0, host(0))] if self.rank != 0 else None
        try:
            store, deadline = self._connect(), time.monotonic() + wait_s
            while True:
                silent = [
                    r
                    for r in range(self.world_size)
                    if r != self.rank and not store.check([f"{self._prefix}/failed/{r}"])
                ]
                if not silent or time.monotonic() >= deadline:
                    return [(r, host(r)) for r in silent] or None
                time.sleep(0.2)
        except Exception:  # noqa: BLE001
            return None

    def forget(self) -> None:
        self._seen.clear()
        self._since, self._read, self.unreachable = None, False, ""

    def observe(self) -> None:
        """Read every other rank's record (only while this rank's own progress is overdue)."""
        now = time.monotonic()
        self._since = self._since or now
        try:
            store = self._connect()
            for r in range(self.world_size):
                key = f"{self._prefix}/{r}"
                if r == self.rank or not store.check([key]):
                    continue
                record = json.loads(store.get(key))
                seen = self._seen.get(r)
                if seen is None or seen[0] != record["seq"]:
                    self._seen[r] = (record["seq"], now, record)
            self.unreachable, self._read = "", True
        except Exception as e:  # noqa: BLE001
            self.unreachable, self._store = f"{type(e).__name__}", None

    def _store_untold(self) -> str | None:
        """The clause when the store has told nothing of the others ('' before this rank looked), else None."""
        if self.unreachable:
            return (
                f"; the job's store at {os.environ.get('MASTER_ADDR')} (rank 0's host) does not answer: "
                "rank 0 or its host is stopped, lost or cut off"
            )
        if self._since is None:
            return ""
        if not self._read:  # its first read has not come back: nothing is known of any rank
            return (
                f"; the job's store at {os.environ.get('MASTER_ADDR')} (rank 0's host) has not answered for "
                f"{time.monotonic() - self._since:.0f} s: rank 0 or its host may be stopped, lost or cut off"
            )
        return None

    def culprit(self, step: int) -> str:
        """'' or a clause: the ranks that stopped, or were blocked, while this one waited (from what
        the following thread has seen so far: no store call here)."""
        now, seen = time.monotonic(), dict(self._seen)
        if (untold := self._store_untold()) is not None:
            return untold
        # how long it has not run: since its last record was written (its host's clock, which the
        # cluster keeps in step), not since this rank began to look, a third of the bound late
        silent = {
            r: max(now - t, time.time() - rec.get("time", time.time()))
            for r, (_, t, rec) in seen.items()
            if now - t > 2 * PUBLISH_S + TICK_S
        }
        if silent:
            return "; waiting for " + ", ".join(
                f"rank {r} ({seen[r][2]['host']}), whose process has not run for {s:.0f} s (stopped, frozen, or its "
                f"host lost)"
                for r, s in sorted(silent.items())
            )
        missing = [r for r in range(self.world_size) if r != self.rank and r not in seen]
        if missing:
            return (
                f"; waiting for rank(s) {', '.join(map(str, missing))}, which never reported after the group formed "
                "(stopped, frozen, or its host lost)"
            )
        reading = [r for r, (_, _, rec) in seen.items() if rec["phase"] == "data"]
        if reading:
            return "; waiting for " + ", ".join(
                f"rank {r} ({seen[r][2]['host']}), blocked in its data read at step {seen[r][2]['step']}"
                for r in sorted(reading)
            )
        behind = [r for r, (_, _, rec) in seen.items() if rec["step"] < step]
        if behind:
            return "; waiting for " + ", ".join(
                f"rank {r} ({seen[r][2]['host']}), still at step {seen[r][2]['step']}" for r in sorted(behind)
            )
        return f"; every rank is alive and waits at step {step} (a deadlock, or a link between hosts is down)"
