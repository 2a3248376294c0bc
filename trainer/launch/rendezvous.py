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

Here too: torchrun's arguments as the job reads them (an option, --rdzv-conf, the config of its
``-m trainer train``), the rendezvous settings a cluster job needs where not given
(:func:`with_rdzv_defaults`), and the one line for a rendezvous that could not form.
"""

from __future__ import annotations

import base64
import functools
import os
import pickle
import re
import socket
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from trainer import contract
from trainer.config import node_range
from trainer.config_loader import load_config
from trainer.contract import EXIT_CRASH, EXIT_DIR_ENV
from trainer.launch.procs import has_children, kill_children

POLL_S = 2.0
FIRST_REPORT_S = 10.0
"""A wait shorter than this is the usual start-up: nothing said."""
REPORT_EVERY_S = 30.0
KEEPALIVE_CHECK_S = 5.0
STALE_HEARTBEAT_S = 15.0
"""A node whose keep-alive in the state is older than this is gone (the rendezvous drops it after keep_alive_max_attempt
missed keep-alives: 3 x 5 s by default)."""
ELASTIC_LAST_CALL_S = 5
"""An elastic group re-forms this long after its MIN nodes are back (torchrun's default: 30 s)."""
ETCD_LAST_CALL_S = 2
"""The same for etcd-v2, shorter: its new round already waits for the lost node's keep-alive key to
expire (a 10 s TTL, fixed in torch), by which time the nodes still there have announced themselves;
with 5 s a loss of rank 0's host took 24-25 s to the next step on an idle test bed (31 s under CI's
load), with 2 s 20-22 s."""
ELASTIC_KEEP_ALIVE_S = 3
"""Seconds between an elastic job's rendezvous keep-alives (torchrun's default: 5 s)."""
STATE_KEY = "torch.rendezvous.{run_id}"
"""Where torch's c10d rendezvous backend keeps its state in the store (C10dRendezvousBackend)."""
STATE_FIELDS = {"round": int, "complete": bool, "participants": dict, "wait_list": set, "redundancy_list": set, "last_heartbeats": dict}
"""What the reporter reads of torch's private _RendezvousState (pickled at STATE_KEY), as torch
2.6-2.14 have it. torch gives no public view of who is in a round; a torch that changes this turns
the reporter's lines off, with one line, rather than have them say wrong things, and
tests/test_rendezvous.py fails first."""


def readable(state: Any) -> bool:
    """Whether ``state`` has the fields the reporter reads, of the types it reads them as."""
    return all(isinstance(getattr(state, name, None), kind) for name, kind in STATE_FIELDS.items())


def training_config(torchrun_args: list[str]) -> Any:
    """The config of ``-m trainer train ...`` in torchrun's arguments, or None (another module, or
    bad input that the workers will report in their own words)."""
    try:
        i = next(i for i in range(len(torchrun_args) - 2) if torchrun_args[i:i + 3] == ["-m", "trainer", "train"])
        rest = torchrun_args[i + 3:]
        config_file = next((rest[j + 1] for j, a in enumerate(rest[:-1]) if a in ("--config", "-c")), None)
        config_file = next((a.split("=", 1)[1] for a in rest if a.startswith("--config=")), config_file)
        overrides = [a for j, a in enumerate(rest) if "=" in a and not a.startswith("-") and (j == 0 or rest[j - 1] not in ("--config", "-c"))]
        return load_config(config_file, overrides)
    except Exception:  # noqa: BLE001
        return None


def option(argv: list[str], name: str, default: str = "") -> str:
    """A torchrun option's value, spelt --name=V, --name V, or with underscores; else, as torchrun
    reads it, from PET_NAME in the environment (what the Kubeflow operators set: PET_NNODES ...)."""
    names = {f"--{name}", f"--{name.replace('-', '_')}"}
    for i, a in enumerate(argv):
        key, eq, value = a.partition("=")
        if key in names:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else default)
    return os.environ.get("PET_" + name.upper().replace("-", "_"), default)


def endpoint(argv: list[str]) -> str:
    """--rdzv-endpoint, or torchrun's default."""
    return option(argv, "rdzv-endpoint") or "127.0.0.1:29400"


def rdzv_conf(argv: list[str]) -> dict[str, str]:
    """torchrun's --rdzv-conf K=V,K=V as a dict."""
    return dict(kv.split("=", 1) for kv in option(argv, "rdzv-conf").split(",") if "=" in kv)


def with_rdzv_defaults(argv: list[str]) -> list[str]:
    """torchrun's arguments with rendezvous settings that suit a cluster job, where not given:

    - read_timeout = join_timeout: c10d store reads that wait as long as the rendezvous does. With
      the default 60 s, a read that times out on a cut link leaves the agent's store connection out
      of step: when the link comes back, the agent fails and closes the rendezvous for every node,
      so a cut over a minute would end the job.
    - for an elastic range (--nnodes MIN:MAX): last_call_timeout = ELASTIC_LAST_CALL_S, so that once
      MIN nodes are back after a node is lost the group re-forms that much later instead of torchrun's
      30 s (a node that comes later joins at the next re-form); keep_alive_interval =
      ELASTIC_KEEP_ALIVE_S, so that a lost node is dropped from the rendezvous after 3 missed
      keep-alives, 9 s instead of 15 s (one small store write per node that often).
    - etcd-v2 (a rendezvous in etcd): last_call_timeout = ETCD_LAST_CALL_S for an elastic range."""
    backend = option(argv, "rdzv-backend")
    if backend not in ("c10d", "etcd-v2"):
        return argv
    conf = rdzv_conf(argv)
    wanted = {"read_timeout": conf.get("join_timeout", "600")} if backend == "c10d" else {}
    if ":" in option(argv, "nnodes", "1"):
        wanted["last_call_timeout"] = str(ELASTIC_LAST_CALL_S if backend == "c10d" else ETCD_LAST_CALL_S)  # etcd-v2: the same key, 30 s too
        if backend == "c10d":
            wanted["keep_alive_interval"] = str(ELASTIC_KEEP_ALIVE_S)
    if all(k in conf for k in wanted):
        return argv
    conf = {**conf, **{k: v for k, v in wanted.items() if k not in conf}}
    out, i = [], 0
    while i < len(argv):  # drop the given --rdzv-conf; the merged one goes first, among torchrun's options
        key, eq, _ = argv[i].partition("=")
        if key in ("--rdzv-conf", "--rdzv_conf"):
            i += 1 if eq else 2
            continue
        out.append(argv[i])
        i += 1
    return [f"--rdzv-conf={','.join(f'{k}={v}' for k, v in conf.items())}", *out]


def where_lost(argv: list[str]) -> str:
    """'at step N (the job resumes from step-M)' from what the workers said when they failed and
    the run folder, as far as they tell."""
    steps = []
    folder = os.environ.get(EXIT_DIR_ENV)
    for p in Path(folder).glob("[0-9]*-*") if folder else []:
        try:
            steps += [int(m) for m in re.findall(r" (?:at|after) step (\d+)", p.read_text())]
        except OSError:
            continue
    from trainer.worker.checkpoint.folder import newest_complete

    cfg = training_config(argv)
    found = newest_complete(Path(cfg.checkpoint.dir)) if cfg else None
    at = f"at step {max(steps)}" if steps else "during training"
    return f"{at} (the job resumes from {found.name})" if found else at


def rendezvous_failure(argv: list[str], error: BaseException, left: list[str] | None = None) -> str:
    """One line for a rendezvous that could not form: what happened, where, and the fix. ``left``:
    nodes of the last group that did not come back (trainer/launch/rendezvous.py saw them go)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

    at = endpoint(argv)
    nodes, job = option(argv, "nnodes", "1"), option(argv, "rdzv-id", "none")
    conf = rdzv_conf(argv)
    if isinstance(error, RendezvousTimeoutError) and left:
        return (f"torchrun: {', '.join(left)}, lost {where_lost(argv)}, did not come back to the rendezvous at {at} "
                f"(id {job}) within {conf.get('join_timeout', '600')} s: start the same command there again, or run elastic "
                f"(--nnodes MIN:{nodes.split(':')[-1]}) so that the nodes left go on; exit {EXIT_CRASH} so that the scheduler retries "
                "from the newest checkpoint")
    if isinstance(error, RendezvousTimeoutError):
        return (f"torchrun: the rendezvous at {at} (id {job}) did not gather {nodes} nodes within "
                f"{conf.get('join_timeout', '600')} s: start the same command on every node (same --rdzv-id, and "
                f"--rdzv-endpoint reachable from each), or wait longer with --rdzv-conf join_timeout=SECONDS")
    if isinstance(error, RendezvousClosedError):
        return (f"torchrun: the rendezvous at {at} (id {job}) was closed: the job ended on another node; "
                "start every node again (with a new --rdzv-id if the old job's nodes are gone)")
    return (f"torchrun: cannot reach the rendezvous at {at} (id {job}): {error or type(error).__name__}; check that "
            "the first node runs and that this node reaches it at that address and port")


class Reporter:
    def __init__(self, endpoint: str, run_id: str, nnodes: str, join_timeout_s: float, say=None):
        host, _, port = endpoint.rpartition(":")
        self.host, self.port = host or endpoint, int(port or 29400)
        self.endpoint, self.run_id, self.join_timeout_s = endpoint, run_id, join_timeout_s
        self.min_nodes, self.max_nodes = node_range(nnodes)
        self.say = say or contract.say
        self.members: list[str] = []
        """The nodes of the group that ran last (host names)."""
        self.left: list[str] = []
        self.round = None
        """The rendezvous round of the group that runs (a member missing from it was dropped)."""
        self._missing: set[str] = set()
        self._unreadable = False
        """torch keeps its rendezvous state in another form than STATE_FIELDS: the lines are off."""
        self._store = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_args(cls, argv: list[str]) -> Reporter | None:
        nnodes = option(argv, "nnodes", "1")
        if option(argv, "rdzv-backend") != "c10d" or nnodes.split(":")[-1] in ("", "1"):
            return None
        return cls(endpoint(argv), option(argv, "rdzv-id", "none"), nnodes, float(rdzv_conf(argv).get("join_timeout", 600)))

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
    def state(self):
        """The rendezvous' shared state (torch's _RendezvousState), or None while it has none (or
        this torch keeps it in a form the reporter does not read: then once a line, and the reporter stops)."""
        if self._unreadable:
            return None
        if self._store is None:
            import torch.distributed as dist

            # a plain connect first: torch's own retries print pages of C++ frames when nobody answers
            socket.create_connection((self.host, self.port), timeout=3).close()
            self._store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
        key = STATE_KEY.format(run_id=self.run_id)
        if not self._store.check([key]):
            return None
        raw = self._store.get(key)
        try:
            state = pickle.loads(base64.b64decode(raw))
        except Exception:  # noqa: BLE001 - the empty sentinel before the first node writes
            return None
        if not readable(state):
            import torch

            self._unreadable = True
            self._stop.set()
            self.say(f"torchrun: torch {torch.__version__} keeps its rendezvous state in another form than this trainer reads "
                     f"({type(state).__name__}): the waiting, re-form and dropped-node lines are off; training is not affected")
            return None
        return state

    def present(self, state) -> list[str]:
        """Host names of the nodes taking part or waiting, whose keep-alive is fresh."""
        now = datetime.now(timezone.utc)
        beats = state.last_heartbeats
        fresh = [n for n in _round_nodes(state) if n not in beats or (now - _utc(beats[n])).total_seconds() < STALE_HEARTBEAT_S]
        return sorted({_host(n) for n in fresh})

    def _run(self) -> None:
        waiting_since, said, checked = None, 0.0, time.monotonic()
        while not self._stop.wait(POLL_S):
            try:
                workers = has_children(os.getpid())
                if workers is None:
                    return  # torchrun itself is gone: nothing to report on
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
                    if line := self.waiting_line(waited):
                        self.say(line)
                        said = now
            except (OSError, RuntimeError):  # a store that does not answer (torch's store errors are RuntimeErrors):
                self._store = None  # the supervisor's own watch acts on that; a bug here still shows its traceback

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
        if state is None or not state.complete:
            return
        me = socket.gethostname().split(".")[0]
        # one leaving for the next round waits in wait_list; a dead one is nowhere
        present = {_host(n) for n in _round_nodes(state)}
        if state.round != self.round:
            # a new round: torchrun stops its workers itself (with a save), unless the round was
            # made without this node while its link was down: then only this node can say so
            if me in self.members and me not in present:
                others = sorted({_host(n) for n in state.participants})
                self._cut_off(me, f"the group re-formed without it ({', '.join(others)})")
                self.members, self.round = others, state.round
            return
        missing = {m for m in self.members if m not in present}
        # missing at two checks in a row: not a node between two steps of its own
        lost, self._missing = sorted(missing & self._missing), missing
        if not lost:
            return
        if me in lost:  # the others' keep-alives got through, this node's did not: it is the one cut off
            self._cut_off(me, "it was dropped from the rendezvous")
        else:
            self.say(f"torchrun: {', '.join(lost)} dropped out of the rendezvous (its keep-alive stopped: lost or cut off) while the "
                     "group trained: stopping this node's workers so that the group re-forms from the newest checkpoint")
            kill_children(os.getpid())
        self.left = lost

    def _cut_off(self, me: str, how: str) -> None:
        """This node was the one cut off: say so (not that the others left) and stop its workers."""
        self.say(f"torchrun: this node ({me}) was cut off: {how} while its rendezvous keep-alive could not get through; "
                 "stopping its workers: it joins the group at the next round")
        kill_children(os.getpid())

    def _joined(self) -> None:
        """Workers run again: the group formed. Say so when its nodes are not the last group's."""
        state = self.state()
        if state is None:
            return
        nodes = sorted({_host(n) for n in state.participants})
        self.round = state.round
        if self.members and nodes and nodes != self.members:
            gone, new = [m for m in self.members if m not in nodes], [n for n in nodes if n not in self.members]
            change = "; ".join(filter(None, [f"{', '.join(gone)} left" if gone else "", f"{', '.join(new)} joined" if new else ""]))
            self.say(f"torchrun: the group re-formed with {len(nodes)} node(s) ({', '.join(nodes)}; {change}): "
                     "training goes on from the newest checkpoint at the new world size")
        if nodes:
            self.members, self.left = nodes, []


def _round_nodes(state) -> set:
    """The nodes the round knows of: taking part, waiting for the next round, or redundant."""
    return set(state.participants) | state.wait_list | state.redundancy_list


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
