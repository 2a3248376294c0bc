"""What a torchrun agent waits for, said while it waits: the rendezvous seen from outside.

torchrun says nothing while its c10d rendezvous gathers nodes (at the start, after a failure, at a
re-form), for up to ``join_timeout`` (600 s). A thread in the torchrun process reads the
rendezvous' state from its store (its own connection, short timeouts) whenever the agent has no
workers, and says in one line every REPORT_EVERY_S what it waits for: the endpoint, the nodes
present, how many more are needed, which node of the last group has not come back, and the time
left before it gives up. When workers run again with another set of nodes, it says that the group
re-formed. Reading costs one small store read every POLL_S while no worker runs.

While workers run, it reads the state every KEEPALIVE_CHECK_S: a node of the group whose
rendezvous keep-alive has stopped (3 missed: 15 s, 9 s for an elastic job) is dropped from the
round's participants by the others' next sync, even when nothing failed (a cable cut, then power
off: the workers would wait in a collective until the hang watchdog or the collective timeout).
This node's workers are then stopped at once, so that torchrun re-forms the group from the
newest checkpoint: without that node when the job is elastic, else waiting for it.
"""

from __future__ import annotations

import base64
import functools
import os
import pickle
import socket
import sys
import threading
import time
from datetime import datetime, timedelta, timezone

POLL_S = 2.0
FIRST_REPORT_S = 10.0
"""A wait shorter than this is the usual start-up: nothing said."""
REPORT_EVERY_S = 30.0
KEEPALIVE_CHECK_S = 5.0
STALE_HEARTBEAT_S = 15.0
"""A node whose keep-alive in the state is older than this is gone (the rendezvous drops it after keep_alive_max_attempt
missed keep-alives: 3 x 5 s by default)."""


def _has_workers(pid: int) -> bool | None:
    from trainer.supervisor import _has_children

    return _has_children(pid)


class Reporter:
    def __init__(self, endpoint: str, run_id: str, nnodes: str, join_timeout_s: float, say=None):
        host, _, port = endpoint.rpartition(":")
        self.host, self.port = host or endpoint, int(port or 29400)
        self.endpoint, self.run_id, self.join_timeout_s = endpoint, run_id, join_timeout_s
        from trainer.config import node_range

        self.min_nodes, self.max_nodes = node_range(nnodes)
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.members: list[str] = []
        """The nodes of the group that ran last (host names)."""
        self.left: list[str] = []
        self.round = None
        """The rendezvous round of the group that runs (a member missing from it was dropped)."""
        self._missing: set[str] = set()
        self._store = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_args(cls, argv: list[str]) -> Reporter | None:
        from trainer.supervisor import _endpoint, _option, rdzv_conf

        nnodes = _option(argv, "nnodes", "1")
        if _option(argv, "rdzv-backend") != "c10d" or nnodes.split(":")[-1] in ("", "1"):
            return None
        return cls(_endpoint(argv), _option(argv, "rdzv-id", "none"), nnodes, float(rdzv_conf(argv).get("join_timeout", 600)))

    def start(self) -> Reporter:
        self._thread = threading.Thread(target=self._run, name="rendezvous-reporter", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------------------------------------
    def state(self):
        """The rendezvous' shared state (torch's _RendezvousState), or None while it has none."""
        if self._store is None:
            import torch.distributed as dist

            # a plain connect first: torch's own retries print pages of C++ frames when nobody answers
            socket.create_connection((self.host, self.port), timeout=3).close()
            self._store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
        key = f"torch.rendezvous.{self.run_id}"
        if not self._store.check([key]):
            return None
        raw = self._store.get(key)
        try:
            return pickle.loads(base64.b64decode(raw))
        except Exception:  # noqa: BLE001 - the empty sentinel before the first node writes
            return None

    def present(self, state) -> list[str]:
        """Host names of the nodes taking part or waiting, whose keep-alive is fresh."""
        now = datetime.now(timezone.utc)
        beats = getattr(state, "last_heartbeats", {})
        fresh = [n for n in _round_nodes(state) if n not in beats or (now - _utc(beats[n])).total_seconds() < STALE_HEARTBEAT_S]
        return sorted({_host(n) for n in fresh})

    def _run(self) -> None:
        waiting_since, said, checked = None, 0.0, time.monotonic()
        while not self._stop.wait(POLL_S):
            try:
                workers = _has_workers(os.getpid())
                if workers is None:
                    return  # no /proc to tell: say nothing rather than guess
                if workers:
                    if waiting_since is not None or not self.members:  # a group formed (this poll's first sight of it)
                        self._joined()
                        checked = time.monotonic()
                    waiting_since = None
                    if time.monotonic() - checked >= KEEPALIVE_CHECK_S:
                        checked = time.monotonic()
                        self._watch_members()
                    continue
                now = time.monotonic()
                waiting_since = waiting_since or now
                waited = now - waiting_since
                if waited >= FIRST_REPORT_S and now - said >= REPORT_EVERY_S:
                    line = self.waiting_line(waited)
                    if line:
                        self.say(line)
                        said = now
            except Exception:  # noqa: BLE001 - a store that does not answer: the supervisor's own watch acts on that
                self._store = None

    def waiting_line(self, waited_s: float) -> str:
        state = self.state()
        here = self.present(state) if state is not None else []
        self.left = [m for m in self.members if m not in here]
        more = max(self.min_nodes - len(here), 0)
        need = f"{more} more node(s) ({self.min_nodes} needed)" if more else f"the round to close ({self.min_nodes}-{self.max_nodes} nodes)"
        gone = f"; {', '.join(self.left)} of the last group not back" if self.left else ""
        left_s = max(self.join_timeout_s - waited_s, 0)
        return (f"torchrun: waiting {waited_s:.0f} s at the rendezvous {self.endpoint} (id {self.run_id}) for {need}; "
                f"present: {', '.join(here) or 'none'}{gone}; gives up in {left_s:.0f} s (join_timeout)")

    def _watch_members(self) -> None:
        """Stop this node's workers when a node of their group has dropped out of the rendezvous:
        every node's sync removes one whose keep-alive stopped (keep_alive_max_attempt missed ones)
        from the participants of the same round, which nothing else does while the group runs."""
        state = self.state()
        if state is None or getattr(state, "round", None) != self.round or not getattr(state, "complete", False):
            return  # a new round is forming: torchrun stops its workers itself (with a save)
        present = {_host(n) for n in _round_nodes(state)}  # one leaving for the next round waits in wait_list; a dead one is nowhere
        missing = {m for m in self.members if m not in present}
        lost, self._missing = sorted(missing & self._missing), missing  # missing at two checks in a row: not a node between two steps of its own
        if not lost:
            return
        from trainer.supervisor import kill_children

        self.say(f"torchrun: {', '.join(lost)} dropped out of the rendezvous (its keep-alive stopped: lost or cut off) while the "
                 "group trained: stopping this node's workers so that the group re-forms from the newest checkpoint")
        kill_children(os.getpid())
        self.left = lost

    def _joined(self) -> None:
        """Workers run again: the group formed. Say so when its nodes are not the last group's."""
        state = self.state()
        if state is None:
            return
        nodes = sorted({_host(n) for n in getattr(state, "participants", {})})
        self.round = getattr(state, "round", None)
        if self.members and nodes and nodes != self.members:
            gone, new = [m for m in self.members if m not in nodes], [n for n in nodes if n not in self.members]
            change = "; ".join(filter(None, [f"{', '.join(gone)} left" if gone else "", f"{', '.join(new)} joined" if new else ""]))
            self.say(f"torchrun: the group re-formed with {len(nodes)} node(s) ({', '.join(nodes)}; {change}): "
                     "training goes on from the newest checkpoint at the new world size")
        if nodes:
            self.members, self.left = nodes, []


def _round_nodes(state) -> set:
    """The nodes the round knows of: taking part, waiting for the next round, or redundant."""
    return set(getattr(state, "participants", {})) | set(getattr(state, "wait_list", ())) | set(getattr(state, "redundancy_list", ()))


@functools.lru_cache(maxsize=256)
def _host(node) -> str:
    """A _NodeDesc's host name (its addr, which --local-addr may have made an address: then its
    name where the resolver knows one), without a domain."""
    addr = str(getattr(node, "addr", node))
    if addr.replace(".", "").isdigit() or ":" in addr:
        try:
            addr = socket.gethostbyaddr(addr)[0]
        except OSError:
            return addr
    return addr.split(".")[0]


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
