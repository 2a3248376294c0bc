"""What torchrun's rendezvous reporter says while a multi-node group waits (trainer/launch/rendezvous.py),
against a real TCPStore; the nodes' own waits are in test_hosts.py."""

import socket
from datetime import datetime, timedelta, timezone

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
    assert line == (f"torchrun: waiting 42 s at the rendezvous 127.0.0.1:{port} (id job-a) for 2 more node(s) (2 needed); "
                    "present: none; gives up in 558 s (join_timeout)")
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

    from trainer.launch.rendezvous import readable

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    state = dynamic._RendezvousState()
    node, waiting = dynamic._NodeDesc("node7.cluster.local", 1, 0), dynamic._NodeDesc("node8", 2, 0)
    state.participants[node], state.complete = 0, True
    state.wait_list.add(waiting)
    state.last_heartbeats[node] = state.last_heartbeats[waiting] = datetime.now(timezone.utc)
    c10d.C10dRendezvousBackend(store, "job-a").set_state(pickle.dumps(state))
    reporter = Reporter(f"127.0.0.1:{port}", "job-a", "2", join_timeout_s=600)
    read = reporter.state()
    assert readable(read) and read.complete and reporter.present(read) == ["node7", "node8"], reporter.present(read)

    # another form (a torch that changed it): one line, and the reporter says nothing more
    said = []
    c10d.C10dRendezvousBackend(store, "job-b").set_state(pickle.dumps({"participants": {}}))
    other = Reporter(f"127.0.0.1:{port}", "job-b", "2", join_timeout_s=600, say=said.append)
    assert other.state() is None and other.state() is None and len(said) == 1
    assert "keeps its rendezvous state in another form than this trainer reads" in said[0] and "training is not affected" in said[0]
    del store
