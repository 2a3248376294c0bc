"""Many machines for real: torchrun (through the supervisor, as every launcher runs it) on hosts of
their own (tests/hosts.py: network namespaces, an address, host name and /etc/hosts each, a decoy
interface listed first), never on 127.0.0.1. Training across hosts, a late and a missing node, a
lost node, a hung rank, stop signals on every host. Needs root (CI runs as root)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, env, newest, weights
from hosts import Bed, namespaces

from trainer.launch import EXIT_PREEMPTED

pytestmark = pytest.mark.slow

PORT = 29400
JOB = [*TINY, "train.epochs=12", "train.log_every=4", "checkpoint.every_steps=8", "checkpoint.keep=50", "dist.hang_timeout_s=10"]
STEPS = 12 * 16  # 16 steps an epoch (512 images, batch 32)
LINE = re.compile(r"epoch (\d+)/\d+ step (\d+)/(\d+)")


class Node:
    """`trainer torchrun` on one host of the bed, its output read as it comes (with the time of each line)."""

    def __init__(self, bed: Bed, host: str, ckpt: Path, job_id: str, *overrides: str, nnodes: int = 2, rdzv: str = "", env_extra=None):
        cmd = [sys.executable, "-m", "trainer", "torchrun", f"--nnodes={nnodes}", "--nproc-per-node=1", "--max-restarts=3",
               "--monitor-interval=0.5", "--rdzv-backend=c10d", f"--rdzv-endpoint=node0:{PORT}", f"--rdzv-id={job_id}", *([rdzv] if rdzv else []),
               "-m", "trainer", "train", *JOB, f"checkpoint.dir={ckpt}", *overrides]
        self.host, self.lines = host, []
        self.proc = bed.popen(host, cmd, cwd=ROOT, env=env(**(env_extra or {})), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    @property
    def out(self) -> str:
        return "".join(line for _, line in self.lines)

    def wait(self, timeout: float = 240) -> int:
        code = self.proc.wait(timeout)
        self.reader.join(10)
        return code

    def when(self, pattern: str, after: float = 0.0, timeout: float = 120) -> float:
        """Block until a line matching ``pattern`` (seen after ``after``) appears; its time."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for t, line in list(self.lines):
                if t >= after and re.search(pattern, line):
                    return t
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.host}: no line matching {pattern!r}\n{self.out[-3000:]}")

    def step(self) -> int:
        """The newest global step this node printed."""
        for _, line in reversed(self.lines):
            m = LINE.search(line)
            if m:
                return (int(m.group(1)) - 1) * int(m.group(3)) + int(m.group(2))
        return 0


@pytest.fixture
def bed():
    with Bed(2, decoy=True) as b:
        yield b
        leftovers = b.leftovers
    assert not leftovers(), "the bed left namespaces behind"


def both_finish(nodes: list[Node], timeout: float = 300) -> None:
    for n in nodes:
        assert n.wait(timeout) == 0, f"{n.host} exited {n.proc.returncode}\n{n.out[-3000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same job uninterrupted across two hosts: what every faulted run must end with, bit for bit."""
    ckpt = tmp_path_factory.mktemp("reference")
    with Bed(2) as b:
        nodes = [Node(b, h, ckpt, "ref") for h in b.names]
        both_finish(nodes)
    return weights(ckpt / f"step-{STEPS}")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_hosts_train_with_a_late_node_then_resume_across_hosts(bed, tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    first = Node(bed, "node0", ckpt, "a")
    time.sleep(8)  # the second node comes late: the first one waits at the rendezvous
    second = Node(bed, "node1", ckpt, "a")
    both_finish([first, second])
    assert "strategy ddp x2" in first.out and f"done: step {STEPS}" in first.out, first.out[-2000:]
    assert same(weights(newest(ckpt)), reference)  # deterministic across hosts, whoever came first
    again = [Node(bed, h, ckpt, "b", "train.epochs=13") for h in bed.names]  # a new launch resumes the run
    both_finish(again)
    assert f"resuming from {ckpt}/step-{STEPS}" in again[0].out and f"done: step {STEPS + 16}" in again[0].out


def test_a_node_that_never_comes_ends_the_wait_with_one_line_naming_the_endpoint(bed, tmp_path):
    alone = Node(bed, "node0", tmp_path / "ckpt", "lonely", rdzv="--rdzv-conf=join_timeout=6")
    code = alone.wait(120)
    assert code not in (0, 2, EXIT_PREEMPTED), alone.out  # a crash: the scheduler may retry when the node is there
    line = [x for x in alone.out.splitlines() if "rendezvous" in x]
    assert len(line) == 1 and f"node0:{PORT}" in line[0] and "did not gather 2 nodes within 6 s" in line[0] and "join_timeout" in line[0], alone.out
    assert "Traceback" not in alone.out
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step-*"))


def test_a_lost_node_comes_back_and_the_job_finishes_with_nothing_lost(bed, tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    nodes = [Node(bed, h, ckpt, "lost") for h in bed.names]
    nodes[0].when(r"epoch 4/12 step 8/")
    t_crash = time.time()
    assert bed.crash("node1") >= 2  # its supervisor, torchrun and worker, at once, as a power cut
    time.sleep(5)  # the node reboots; the scheduler starts the same command there again
    nodes[1] = Node(bed, "node1", ckpt, "lost")
    t_back = nodes[0].when(r"epoch \d+/12 step \d+/", after=nodes[0].when("resuming from", after=t_crash))
    print(f"lost node: node1 killed -> node0's next training step in {t_back - t_crash:.1f} s (5 s of it the node was down)")
    both_finish(nodes)
    assert same(weights(newest(ckpt)), reference)


def test_a_hung_rank_on_another_host_is_caught_and_the_job_finishes(bed, tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    nodes = [Node(bed, h, ckpt, "hung") for h in bed.names]
    nodes[0].when(r"epoch 3/12 step 4/")
    worker = next(p for p in bed.pids("node1") if Path(f"/proc/{p}/cmdline").read_text().split("\0")[1:4] == ["-u", "-m", "trainer"])
    t_stop = time.time()
    subprocess.run(["kill", "-STOP", str(worker)], check=True)
    t_back = nodes[0].when(r"epoch \d+/12 step \d+/", after=nodes[0].when("resuming from", after=t_stop, timeout=90))
    print(f"hung rank on node1 (SIGSTOP) -> training again in {t_back - t_stop:.1f} s (dist.hang_timeout_s=10)")
    assert t_back - t_stop < 10 + 30 + 15  # the bound, the supervisor's margin and a restart
    both_finish(nodes)
    assert "state T (stopped)" in nodes[1].out
    assert (ckpt / "hang-rank0.txt").is_file()  # rank 0 waited for it in a collective: its stacks say where
    assert same(weights(newest(ckpt)), reference)


def test_sigterm_on_every_host_saves_once_exits_75_everywhere_and_resumes(bed, tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    nodes = [Node(bed, h, ckpt, "term") for h in bed.names]
    nodes[0].when(r"epoch 5/12 step 4/")
    for n in nodes:  # Slurm's preemption and Kubernetes' pod deletion signal every node
        n.proc.send_signal(signal.SIGTERM)
    codes = [n.wait(120) for n in nodes]
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], [n.out[-2000:] for n in nodes]
    stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint saved", nodes[0].out)
    assert stopped, nodes[0].out[-2000:]
    assert newest(ckpt).name == f"step-{stopped.group(1)}"
    again = [Node(bed, h, ckpt, "term2") for h in bed.names]
    both_finish(again)
    assert f"resuming from {ckpt}/step-{stopped.group(1)}" in again[0].out
    assert same(weights(newest(ckpt)), reference)


def test_nothing_is_left_behind():
    """Runs last in this module: no namespace of any bed, no training process."""
    assert not [ns for ns in namespaces() if ns.startswith("ct-")]
    p = subprocess.run(["pgrep", "-f", "trainer (train|torchrun)"], capture_output=True, text=True)
    assert not p.stdout.strip(), p.stdout
