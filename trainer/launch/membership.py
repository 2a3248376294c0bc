"""Who is in torchrun's rendezvous, read from outside. Both backends a cluster job uses, c10d (a
TCPStore on the first node) and etcd-v2 (an etcd of its own), are torch's dynamic rendezvous: the
same state, pickled and base64-encoded under one key (c10d: STATE_KEY in the store; etcd-v2:
ETCD_KEY), that every node's agent rewrites at each keep-alive. Both readers give a :class:`Round`,
the one form the reporter (trainer/launch/rendezvous.py) reads.

torch gives no public view of a rendezvous' members, so the readers read torch's private
_RendezvousState (STATE_FIELDS). A torch that changes it turns the reporter's lines off, with one
line, and tests/test_rendezvous.py fails first.
"""

from __future__ import annotations

import base64
import functools
import pickle
import socket
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

STALE_HEARTBEAT_S = 15.0
"""A node whose keep-alive in the state is older than this is gone (the rendezvous drops it after
keep_alive_max_attempt missed keep-alives: 3 x 5 s by default)."""
STATE_KEY = "torch.rendezvous.{run_id}"
"""Where torch's c10d rendezvous backend keeps its state in the store (C10dRendezvousBackend)."""
ETCD_KEY = "/torch/elastic/rendezvous/{run_id}"
"""Where torch's etcd-v2 rendezvous backend keeps it in etcd (EtcdRendezvousBackend)."""
STATE_FIELDS = {
    "round": int,
    "complete": bool,
    "participants": dict,
    "wait_list": set,
    "redundancy_list": set,
    "last_heartbeats": dict,
}
"""What is read of torch's private _RendezvousState, as torch 2.6-2.14 have it."""


@dataclass
class Round:
    """The rendezvous as one read saw it."""

    id: int | None = None
    """The round of the group formed last, or being formed."""
    complete: bool = False
    """Whether that group is formed (its workers run), not gathering."""
    members: list[str] = field(default_factory=list)
    """Host names of the round's participants."""
    nodes: set[str] = field(default_factory=set)
    """Host names of the nodes the round holds: taking part, or waiting for the next round. A member
    of a running group not among them was dropped (its keep-alive stopped)."""
    present: list[str] = field(default_factory=list)
    """Host names of the nodes taking part or waiting whose keep-alive is fresh."""


def readable(state: Any) -> bool:
    """Whether ``state`` has the fields read, of the types they are read as."""
    return all(isinstance(getattr(state, name, None), kind) for name, kind in STATE_FIELDS.items())


class Unreadable(Exception):
    """torch keeps its rendezvous state in another form than this reads."""


class View:
    """A rendezvous backend's state, read with a connection of this reader's own."""

    def raw(self) -> str | bytes | None:
        """The base64 state as the backend keeps it, or None while there is none. OSError (or torch's
        RuntimeError) where the backend does not answer."""
        raise NotImplementedError

    def state(self):
        """torch's _RendezvousState, or None while the backend has none."""
        raw = self.raw()
        if raw is None:
            return None
        try:
            state = pickle.loads(base64.b64decode(raw))
        except Exception:  # noqa: BLE001 - the empty sentinel before the first node writes
            return None
        if not readable(state):
            raise Unreadable(type(state).__name__)
        return state

    def read(self, since: datetime | None = None) -> Round | None:
        """The rendezvous now. ``since``: when this node began to wait; a node counts as present only
        with a keep-alive since then (a lost node stays in the last round, its keep-alive fresh for
        up to STALE_HEARTBEAT_S, until a sync drops it; a live one renews its keep-alive every 5 s)."""
        state = self.state()
        if state is None:
            return None
        now = datetime.now(timezone.utc)
        beats, known = state.last_heartbeats, _round_nodes(state)
        fresh = [
            n
            for n in known
            if n not in beats
            or (
                (now - _utc(beats[n])).total_seconds() < STALE_HEARTBEAT_S
                and (since is None or _utc(beats[n]) >= since)
            )
        ]
        return Round(
            id=state.round,
            complete=state.complete,
            members=sorted({_host(n) for n in state.participants}),
            nodes={_host(n) for n in known},
            present=sorted({_host(n) for n in fresh}),
        )


class C10dView(View):
    """c10d: the TCPStore on the first node (a plain connect first: torch's own retries print pages
    of C++ frames when nobody answers)."""

    def __init__(self, host: str, port: int, run_id: str):
        self.host, self.port, self.key = host, port, STATE_KEY.format(run_id=run_id)
        self._store = None

    def raw(self) -> bytes | None:
        try:
            if self._store is None:
                import torch.distributed as dist

                socket.create_connection((self.host, self.port), timeout=3).close()
                self._store = dist.TCPStore(
                    self.host, self.port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False
                )
            return self._store.get(self.key) if self._store.check([self.key]) else None
        except (OSError, RuntimeError):  # connected again at the next read
            self._store = None
            raise


class EtcdView(View):
    """etcd-v2: the key in etcd, read through python-etcd as torch's backend reads it (with its
    --rdzv-conf protocol and certificates), with a short timeout."""

    def __init__(self, host: str, port: int, run_id: str, conf: dict[str, str]):
        import etcd

        cert = (
            (conf["ssl_cert"], conf["ssl_cert_key"])
            if conf.get("ssl_cert") and conf.get("ssl_cert_key")
            else conf.get("ssl_cert")
        )
        self._client = etcd.Client(
            host,
            port,
            protocol=conf.get("protocol", "http"),
            cert=cert,
            ca_cert=conf.get("ca_cert"),
            read_timeout=3,
            allow_reconnect=True,
        )
        self.key = ETCD_KEY.format(run_id=run_id)

    def raw(self) -> str | None:
        import etcd

        try:
            return self._client.read(self.key).value
        except etcd.EtcdKeyNotFound:
            return None
        except etcd.EtcdException as e:  # EtcdConnectionFailed and the like: "does not answer"
            raise OSError(f"etcd: {e}") from e


def view(backend: str, endpoint: str, run_id: str, conf: dict[str, str]) -> View | None:
    """The reader of ``backend``'s state at ``endpoint``; None for a backend not read."""
    host, _, port = endpoint.rpartition(":")
    if backend == "c10d":
        return C10dView(host or endpoint, int(port or 29400), run_id)
    if backend == "etcd-v2":
        return EtcdView(host or endpoint, int(port or 2379), run_id, conf)
    return None


def _round_nodes(state) -> set:
    """The nodes a c10d round knows of: taking part, waiting for the next round, or redundant."""
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
