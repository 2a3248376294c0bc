"""What torchrun's rendezvous reporter says while a multi-node group waits (trainer/rendezvous.py),
against a real TCPStore; the nodes' own waits are in test_hosts.py."""

import socket
from datetime import timedelta

import torch.distributed as dist

from trainer.rendezvous import Reporter


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
