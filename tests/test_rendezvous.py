"""What torchrun's rendezvous reporter says while a multi-node group waits (trainer/launch/rendezvous.py),
against a real TCPStore; the nodes' own waits are in test_hosts.py."""

import socket
from datetime import datetime, timedelta, timezone

import pytest
import torch.distributed as dist

from trainer.launch.rendezvous import Reporter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_wait_with_no_node_yet_is_one_line_on_the_console(capsys):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    reporter = Reporter(f"127.0.0.1:{port}", "job-a", "2", join_timeout_s=600)
    line = reporter.waiting_line(42.4)
    assert line == (
        f"torchrun: waiting 42 s at the rendezvous 127.0.0.1:{port} (id job-a) for 2 more node(s) (2 needed); "
        "present: none; gives up in 558 s (join_timeout)"
    )
    reporter.say(line)  # the default: the console, at once
    assert capsys.readouterr().err == line + "\n"
    del store


def test_torchs_private_rendezvous_state_is_in_the_form_the_reporter_reads():
    """No public torch API says who is in a rendezvous round, so the reporter reads torch's private
    state: its store key, its fields, a node's address. Written here as torch's c10d backend writes
    it; a torch upgrade that changes any of it fails this test, not a cluster's console lines."""
    import pickle

    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic

    from trainer.launch.membership import readable

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    state = dynamic._RendezvousState()
    node, waiting = dynamic._NodeDesc("node7.cluster.local", 1, 0), dynamic._NodeDesc("node8", 2, 0)
    state.participants[node], state.complete = 0, True
    state.wait_list.add(waiting)
    state.last_heartbeats[node] = state.last_heartbeats[waiting] = datetime.now(timezone.utc)
    c10d.C10dRendezvousBackend(store, "job-a").set_state(pickle.dumps(state))
    reporter = Reporter(f"127.0.0.1:{port}", "job-a", "2", join_timeout_s=600)
    assert readable(reporter.view.state())
    read = reporter.read()
    assert read.complete and read.present == ["node7", "node8"] and read.members == ["node7"], read

    # another form (a torch that changed it): one line, and the reporter says nothing more
    said = []
    c10d.C10dRendezvousBackend(store, "job-b").set_state(pickle.dumps({"participants": {}}))
    other = Reporter(f"127.0.0.1:{port}", "job-b", "2", join_timeout_s=600, say=said.append)
    assert other.read() is None and other.read() is None and len(said) == 1
    assert (
        "keeps its rendezvous state in another form than this trainer reads" in said[0]
        and "training is not affected" in said[0]
    )
    del store


@pytest.mark.slow  # an etcd server (Debian's etcd-server): make test-slow, which CI runs
def test_under_etcd_a_node_whose_keep_alive_stopped_is_named_and_the_workers_stopped(etcd_server, monkeypatch):
    """Two nodes form a real etcd-v2 rendezvous (torch's own handlers, one per thread, node8 and
    node9). node9's keep-alive stops (its host cut, then its power gone: nothing is closed); node8's
    next syncs drop it from the round. The reporter names node9 once it is missing at two reads in
    a row and stops this node's workers so that the group re-forms; before that, no line."""
    import threading
    import time

    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    from trainer.launch import rendezvous

    at = f"127.0.0.1:{etcd_server}"
    # no workers' store on node8, which does not resolve here
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    handlers = [
        registry.get_rendezvous_handler(
            RendezvousParameters(
                "etcd-v2", at, "job-e", 2, 2, local_addr=host, keep_alive_interval=1, last_call_timeout=1
            )
        )
        for host in ("node8", "node9")
    ]
    threads = [threading.Thread(target=h.next_rendezvous) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    killed, said = [], []
    monkeypatch.setattr(rendezvous, "kill_children", killed.append)
    reporter = Reporter(at, "job-e", "1:2", join_timeout_s=600, say=said.append, backend="etcd-v2")
    reporter._joined(frozenset({1}))
    assert reporter.members == ["node8", "node9"] and reporter.round is not None, reporter.members
    reporter._watch_members()
    reporter._watch_members()
    assert not said and not killed  # every keep-alive is fresh: nobody named

    handlers[1]._stop_heartbeats()  # node9's agent renews no more
    deadline = time.monotonic() + 30
    while not said and time.monotonic() < deadline:
        reporter._watch_members()
        time.sleep(1)
    assert len(said) == 1 and said[0].startswith("torchrun: node9 dropped out of the rendezvous") and killed, said
    line = reporter.waiting_line(42)
    assert (
        "present: node8; node9 of the last group not back" in line and "for the round to close (1-2 nodes)" in line
    ), line
    for h in handlers:
        h.shutdown()
