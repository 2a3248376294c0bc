"""What a torchrun agent waits for, said while it waits: the rendezvous seen from outside.

torchrun says nothing while its rendezvous (c10d, or etcd-v2 in an etcd of its own) gathers nodes
(at the start, after a failure, at a re-form), for up to ``join_timeout`` (600 s). A thread in the
torchrun process reads the rendezvous' state (trainer/launch/membership.py: its own connection,
short timeouts) whenever the agent has no workers, and says in one line every REPORT_EVERY_S what
it waits for: the endpoint, the nodes present, how many more are needed, which node of the last
group has not come back, and the time left before it gives up. Whenever workers run again it says
that the group re-formed, and with which nodes. Reading costs one small read every POLL_S while no
worker runs.

While workers run, it reads the state every KEEPALIVE_CHECK_S: a node of the group whose
rendezvous keep-alive has stopped (3 missed: 15 s, 9 s for an elastic job) is dropped from the
round's participants by the others' next sync, even when nothing failed (a cable cut, then power
off: the workers would wait in a collective until the hang watchdog or the collective timeout).
This node's workers are then stopped at once, so that torchrun re-forms the group from the newest checkpoint: without
that node
when the job is elastic, else waiting for it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import datetime, timedelta, timezone

from trainer import contract
from trainer.config import node_range
from trainer.launch import membership
from trainer.launch.membership import Round, Unreadable
from trainer.launch.procs import kill_children, live_children
from trainer.launch.torchrun_args import endpoint, option, rdzv_conf

POLL_S = 2.0
FIRST_REPORT_S = 10.0
"""A wait shorter than this is the usual start-up: nothing said."""
REPORT_EVERY_S = 30.0
KEEPALIVE_CHECK_S = 5.0


class Reporter:
    def __init__(
        self,
        endpoint: str,
        run_id: str,
        nnodes: str,
        join_timeout_s: float,
        say=None,
        backend: str = "c10d",
        conf: dict[str, str] | None = None,
    ):
        self.endpoint, self.run_id, self.join_timeout_s = endpoint, run_id, join_timeout_s
        self.view = membership.view(backend, endpoint, run_id, conf or {})
        self.min_nodes, self.max_nodes = node_range(nnodes)
        self.say = say or contract.say
        self.members: list[str] = []
        """The nodes of the group that ran last (host names)."""
        self.left: list[str] = []
        self.round = None
        """The rendezvous round of the group that runs (a member missing from it was dropped)."""
        self._workers: frozenset[int] = frozenset()
        """The workers of the group last seen formed: others are a new group's."""
        self._missing: set[str] = set()
        self._unreadable = False
        """torch keeps its rendezvous state in another form than membership.py reads: the lines are off."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_args(cls, argv: list[str]) -> Reporter | None:
        nnodes, backend = option(argv, "nnodes", "1"), option(argv, "rdzv-backend")
        if backend not in ("c10d", "etcd-v2") or nnodes.split(":")[-1] in ("", "1"):
            return None
        conf = rdzv_conf(argv)
        return cls(
            endpoint(argv),
            option(argv, "rdzv-id", "none"),
            nnodes,
            float(conf.get("join_timeout", 600)),
            backend=backend,
            conf=conf,
        )

    def start(self) -> Reporter:
        self._thread = threading.Thread(target=self._run, name="rendezvous-reporter", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and wait for it (seconds at most: one store connect): a thread still inside
        the store's C++ client when the interpreter exits aborts the process (exit 134, not torchrun's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    # ---------------------------------------------------------------------------------------------
    def read(self, since: datetime | None = None) -> Round | None:
        """The rendezvous as it is now, or None while it has no state (or this torch keeps it in a form
        not read: then once a line, and the reporter stops)."""
        if self._unreadable:
            return None
        try:
            return self.view.read(since)
        except Unreadable as e:
            import torch

            self._unreadable = True
            self._stop.set()
            self.say(
                f"torchrun: torch {torch.__version__} keeps its rendezvous state in another form than this trainer "
                f"reads "
                f"({e}): the waiting, re-form and dropped-node lines are off; training is not affected"
            )
            return None

    def _run(self) -> None:
        waiting_since, said, checked = None, 0.0, time.monotonic()
        while not self._stop.wait(POLL_S):
            try:
                workers = live_children(os.getpid())
                if workers is None:
                    return  # torchrun itself is gone: nothing to report on
                if workers:
                    waiting_since = None
                    if workers != self._workers:  # a group formed (this poll's first sight of it)
                        self._joined(workers)
                        checked = time.monotonic()
                    elif time.monotonic() - checked >= KEEPALIVE_CHECK_S:
                        checked = time.monotonic()
                        self._watch_members()
                    continue
                now = time.monotonic()
                waiting_since = waiting_since or now
                waited = now - waiting_since
                if waited >= FIRST_REPORT_S and now - said >= REPORT_EVERY_S:
                    if line := self.waiting_line(waited):
                        self.say(line)
                        said = now
            except (
                OSError,
                RuntimeError,
            ):  # a rendezvous that does not answer (torch's store errors are RuntimeErrors):
                pass  # the supervisor's own watch acts on that; a bug here still shows its traceback

    def waiting_line(self, waited_s: float) -> str:
        r = self.read(since=datetime.now(timezone.utc) - timedelta(seconds=waited_s)) or Round()
        self.left = [m for m in self.members if m not in r.present]
        more = max(self.min_nodes - len(r.present), 0)
        need = (
            f"{more} more node(s) ({self.min_nodes} needed)"
            if more
            else f"the round to close ({self.min_nodes}-{self.max_nodes} nodes)"
        )
        here = ", ".join(r.present) or "none"
        gone = f"; {', '.join(self.left)} of the last group not back" if self.left else ""
        left_s = max(self.join_timeout_s - waited_s, 0)
        return (
            f"torchrun: waiting {waited_s:.0f} s at the rendezvous {self.endpoint} (id {self.run_id}) for {need}; "
            f"present: {here}{gone}; gives up in {left_s:.0f} s (join_timeout)"
        )

    def _watch_members(self) -> None:
        """Stop this node's workers when a node of their group has dropped out of the rendezvous:
        every node's sync removes one whose keep-alive stopped (keep_alive_max_attempt missed ones)
        from the participants of the same round, which nothing else does while the group runs."""
        r = self.read()
        if r is None or not r.complete:
            return
        me = socket.gethostname().split(".")[0]
        if r.id != self.round:
            # a new round: torchrun stops its workers itself (with a save), unless the round was
            # made without this node while its link was down: then only this node can say so
            if me in self.members and me not in r.nodes:
                self._cut_off(me, f"the group re-formed without it ({', '.join(r.members)})")
                self.members, self.round = r.members, r.id
            return
        missing = {m for m in self.members if m not in r.nodes}
        # missing at two checks in a row: not a node between two steps of its own
        lost, self._missing = sorted(missing & self._missing), missing
        if not lost:
            return
        if me in lost:  # the others' keep-alives got through, this node's did not: it is the one cut off
            self._cut_off(me, "it was dropped from the rendezvous")
        else:
            self.say(
                f"torchrun: {', '.join(lost)} dropped out of the rendezvous (its keep-alive stopped: lost or cut off) "
                f"while the "
                "group trained: stopping this node's workers so that the group re-forms from the newest checkpoint"
            )
            kill_children(os.getpid())
        self.left = lost

    def _cut_off(self, me: str, how: str) -> None:
        """This node was the one cut off: say so (not that the others left) and stop its workers."""
        self.say(
            f"torchrun: this node ({me}) was cut off: {how} while its rendezvous keep-alive could not get through; "
            "stopping its workers: it joins the group at the next round"
        )
        kill_children(os.getpid())

    def _joined(self, workers: frozenset[int]) -> None:
        """Workers run: a group formed. After the first, say that it re-formed, and with which nodes."""
        r = self.read()
        if r is None or not r.complete:
            return  # again at the next poll
        nodes = r.members
        if self.members and nodes:
            gone, new = [m for m in self.members if m not in nodes], [n for n in nodes if n not in self.members]
            change = "; ".join(
                filter(None, [f"{', '.join(gone)} left" if gone else "", f"{', '.join(new)} joined" if new else ""])
            )
            self.say(
                f"torchrun: the group re-formed with {len(nodes)} node(s) "
                f"({', '.join(nodes)}{'; ' + change if change else ''}): "
                f"training goes on from the newest checkpoint{' at the new world size' if change else ''}"
            )
        self.round, self._workers, self._missing = r.id, workers, set()
        if nodes:
            self.members, self.left = nodes, []
