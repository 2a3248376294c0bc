"""Many machines for real: torchrun (through the supervisor, as every launcher runs it) on hosts of
their own (tests/hosts.py: network namespaces, an address, host name and /etc/hosts each, a decoy
interface listed first), never on 127.0.0.1. Training across hosts, a late and a missing node, a
lost node, a hung rank, stop signals on every host, cut links, an elastic job; a PyTorchJob's pods
on hosts of their own. Slurm across hosts: tests/test_hosts_slurm.py. Every bed checks that it left
nothing; `python tests/hosts.py --check` (after the suite) that no process of a bed is left. Needs
root (CI runs as root)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, env, made_once, newest, slow_steps, weights
from hosts import Bed

from trainer.contract import EXIT_PREEMPTED

pytestmark = pytest.mark.slow

PORT = 29400
JOB = [
    *TINY,
    "train.epochs=12",
    "train.log_every=4",
    "checkpoint.every_steps=8",
    "checkpoint.keep=50",
    "dist.hang_timeout_s=10",
]
STEPS = 12 * 16  # 16 steps an epoch (512 images, batch 32)


class Proc:
    """A command on one host of the bed, its output read as it comes (with the time of each line)."""

    def __init__(self, bed: Bed, host: str, cmd: list[str], environ: dict[str, str]):
        self.host, self.lines = host, []
        self.proc = bed.popen(
            host, cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
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


def node(
    bed: Bed,
    host: str,
    ckpt: Path,
    job_id: str,
    *overrides: str,
    nnodes: int | str = 2,
    rdzv: str = "",
    endpoint: str = "node0",
    environ: dict[str, str] | None = None,
    backend: str = "c10d",
    port: int = PORT,
) -> Proc:
    """`trainer torchrun` on ``host``, as every launcher of ours runs it, its rendezvous (c10d, or
    etcd-v2) at ``endpoint``."""
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "torchrun",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--max-restarts=3",
        "--monitor-interval=0.5",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}:{port}",
        f"--rdzv-id={job_id}",
        *([rdzv] if rdzv else []),
        "-m",
        "trainer",
        "train",
        *JOB,
        f"checkpoint.dir={ckpt}",
        *overrides,
    ]
    return Proc(bed, host, cmd, env(**(environ or {})))


@pytest.fixture
def bed():
    with Bed(2, decoy=True) as b:
        yield b
    assert not b.leftovers(), "the bed left namespaces behind"


def both_finish(nodes: list[Proc], timeout: float = 300) -> None:
    for n in nodes:
        assert n.wait(timeout) == 0, f"{n.host} exited {n.proc.returncode}\n{n.out[-3000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same job uninterrupted across two hosts: what every faulted run must end with, bit for bit."""

    def make(ckpt: Path) -> None:
        with Bed(2) as b:
            both_finish([node(b, h, ckpt, "ref") for h in b.names])

    return weights(made_once(tmp_path_factory, "hosts-reference", make) / f"step-{STEPS}")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_hosts_train_with_a_late_node_then_resume_across_hosts(bed, tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    first = node(bed, "node0", ckpt, "a")
    t_first = time.time()
    waiting = first.when(r"torchrun: waiting \d+ s at the rendezvous node0:\d+ \(id a\) for 1 more node", timeout=30)
    # the second node comes late: the first one says what it waits for
    assert waiting - t_first < 30 and "present: node0;" in first.out
    second = node(bed, "node1", ckpt, "a")
    both_finish([first, second])
    assert "strategy ddp x2" in first.out and f"done: step {STEPS}" in first.out, first.out[-2000:]
    assert same(weights(newest(ckpt)), reference)  # deterministic across hosts, whoever came first
    again = [node(bed, h, ckpt, "b", "train.epochs=13") for h in bed.names]  # a new launch resumes the run
    both_finish(again)
    assert f"resuming from {ckpt}/step-{STEPS}" in again[0].out and f"done: step {STEPS + 16}" in again[0].out


def test_a_node_that_never_comes_ends_the_wait_with_one_line_naming_the_endpoint(bed, tmp_path):
    alone = node(bed, "node0", tmp_path / "ckpt", "lonely", rdzv="--rdzv-conf=join_timeout=6")
    code = alone.wait(120)
    assert code not in (0, 2, EXIT_PREEMPTED), alone.out  # a crash: the scheduler may retry when the node is there
    line = [x for x in alone.out.splitlines() if "rendezvous" in x]
    assert (
        len(line) == 1
        and f"node0:{PORT}" in line[0]
        and "did not gather 2 nodes within 6 s" in line[0]
        and "join_timeout" in line[0]
    ), alone.out
    assert "Traceback" not in alone.out
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step-*"))


def test_a_lost_node_comes_back_and_the_job_finishes_with_nothing_lost(bed, tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    nodes = [node(bed, h, ckpt, "lost") for h in bed.names]
    nodes[0].when(r"epoch 4/12 step 8/")
    t_crash = time.time()
    assert bed.crash("node1") >= 2  # its supervisor, torchrun and worker, at once, as a power cut
    said = nodes[0].when(
        r"rank 0 \(node0\): lost rank 1 \(node1\) at step \d+: "
        r".*torchrun goes back to its rendezvous to re-form the group from step-\d+",
        after=t_crash,
        timeout=30,
    )
    waits = nodes[0].when(
        r"torchrun: waiting \d+ s at the rendezvous .* for 1 more node.*; "
        r"node1 of the last group not back; gives up in",
        after=t_crash,
        timeout=40,
    )
    print(f"lost node: named {said - t_crash:.1f} s after the crash, the wait said {waits - t_crash:.1f} s after it")
    assert "Traceback" not in nodes[0].out  # one line, the traceback in the run folder
    # gloo's own words for the lost peer, whichever way the connection went down
    assert re.search(r"Connection (reset|closed) by peer", (ckpt / "error-rank0.txt").read_text())
    nodes[1] = node(bed, "node1", ckpt, "lost")  # the node reboots; the scheduler starts the same command there again
    t_back = nodes[0].when(r"epoch \d+/12 step \d+/", after=nodes[0].when("resuming from", after=t_crash))
    print(
        f"lost node: node1 killed -> node0's next training step in {t_back - t_crash:.1f} s (the node down for "
        f"{waits - t_crash:.0f} s of it)"
    )
    both_finish(nodes)
    assert same(weights(newest(ckpt)), reference)


def test_a_rank_slow_for_good_is_named_a_straggler_and_a_brief_slowdown_is_not(bed, tmp_path):
    """Each rank on a host of its own. node1's rank waits 0.4 s before every batch (a host slower
    for good); node0's rank once waits 1.5 s (a brief slowdown). The progress line names rank 1 on
    node1, never rank 0."""
    ckpt = tmp_path / "ckpt"
    job = ["train.epochs=3", "checkpoint.every_steps=0"]  # 48 steps: 19 s of the slow host, past Stragglers.PERSIST_S
    nodes = [
        node(
            bed, "node0", ckpt, "slow", *job, environ={"TRAINER_FAULT": "batch@6:sleep=1.5", "TRAINER_FAULT_RANK": "0"}
        ),
        node(bed, "node1", ckpt, "slow", *job, environ={"TRAINER_FAULT": "batch:slow=0.4", "TRAINER_FAULT_RANK": "1"}),
    ]
    both_finish(nodes)
    out = nodes[0].out
    assert re.search(r"straggler: rank 1 \(node1\) [\d.]+x the others' median for \d+ s", out), out[-3000:]
    assert "straggler: rank 0" not in out, out[-3000:]


def test_a_lost_node_that_never_returns_is_named_and_the_wait_ends_in_a_crash_code(bed, tmp_path):
    """Not elastic: the survivor says whom it lost at once, what it waits for while it waits, and
    at the end of the wait (join_timeout, here 20 s) which node did not come back and the fix."""
    ckpt = tmp_path / "ckpt"
    nodes = [node(bed, h, ckpt, "gone", rdzv="--rdzv-conf=join_timeout=20") for h in bed.names]
    nodes[0].when(r"epoch 2/12 step 8/")
    t_crash = time.time()
    bed.crash("node1")
    said = nodes[0].when(r"lost rank 1 \(node1\) at step \d+", after=t_crash, timeout=30)
    code = nodes[0].wait(20 + 60)
    t_end = time.time()
    print(
        f"lost node, never back: named {said - t_crash:.1f} s after the crash; exit {code} {t_end - t_crash:.1f} s "
        f"after it (join_timeout 20 s)"
    )
    assert code not in (0, 2, EXIT_PREEMPTED), nodes[0].out[-2000:]
    last = [x for x in nodes[0].out.splitlines() if "did not come back" in x]
    assert (
        len(last) == 1
        and re.search(r"node1, lost at step \d+ \(the job resumes from step-\d+\)", last[0])
        and "--nnodes MIN:2" in last[0]
    ), last
    assert "wait longer" not in nodes[0].out


def test_a_hung_rank_on_another_host_is_caught_and_the_job_finishes(bed, tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    nodes = [node(bed, h, ckpt, "hung") for h in bed.names]
    nodes[0].when(r"epoch 3/12 step 4/")
    worker = next(
        p
        for p in bed.pids("node1")
        if Path(f"/proc/{p}/cmdline").read_text().split("\0")[1:4] == ["-u", "-m", "trainer"]
    )
    t_stop = time.time()
    subprocess.run(["kill", "-STOP", str(worker)], check=True)
    t_back = nodes[0].when(r"epoch \d+/12 step \d+/", after=nodes[0].when("resuming from", after=t_stop, timeout=90))
    print(f"hung rank on node1 (SIGSTOP) -> training again in {t_back - t_stop:.1f} s (dist.hang_timeout_s=10)")
    assert t_back - t_stop < 10 + 30 + 15  # the bound, the supervisor's margin and a restart
    both_finish(nodes)
    assert ", stopped) has made no progress" in nodes[1].out
    # the step on both consoles, the waiting rank's and the stopped one's (its supervisor's line, from
    # the worker's shared step: the heartbeat file lagged a second of steps): the same, or the stopped
    # one a step behind when it stopped between its step's gradient all-reduce and the step's end
    steps = [
        int(
            re.search(
                r"after step (\d+)",
                next(x for x in n.out.splitlines() if "no training progress" in x or ", stopped) has made" in x),
            ).group(1)
        )
        for n in nodes
    ]
    assert 0 <= steps[0] - steps[1] <= 1, "\n".join(
        x for n in nodes for x in n.out.splitlines() if "after step" in x or ", stopped) has made" in x
    )
    # node0's console names the rank that stopped, not only its own wait
    assert re.search(
        r"rank 0 \(node0\): no training progress .*waiting for rank 1 \(node1\), whose process has not run",
        nodes[0].out,
    ), [x for x in nodes[0].out.splitlines() if "progress" in x or "lost" in x]
    assert (ckpt / "hang-rank0.txt").is_file()  # rank 0 waited for it in a collective: its stacks say where
    assert same(weights(newest(ckpt)), reference)


def test_sigterm_on_every_host_saves_once_exits_75_everywhere_and_resumes(bed, tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    nodes = [node(bed, h, ckpt, "term") for h in bed.names]
    nodes[0].when(r"epoch 5/12 step 4/")
    for n in nodes:  # Slurm's preemption and Kubernetes' pod deletion signal every node
        n.proc.send_signal(signal.SIGTERM)
    codes = [n.wait(120) for n in nodes]
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], [n.out[-2000:] for n in nodes]
    stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint saved", nodes[0].out)
    assert stopped, nodes[0].out[-2000:]
    assert newest(ckpt).name == f"step-{stopped.group(1)}"
    again = [node(bed, h, ckpt, "term2") for h in bed.names]
    both_finish(again)
    assert f"resuming from {ckpt}/step-{stopped.group(1)}" in again[0].out
    assert same(weights(newest(ckpt)), reference)


CUT_S = 60  # 3 x dist.timeout_s: every rank is caught first; the bound (join_timeout) is 600 s


def test_a_link_cut_of_a_minute_is_ridden_out_and_the_job_finishes_with_nothing_lost(bed, tmp_path, reference):
    """Longer than dist.timeout_s: every rank is caught (the watchdog, the collective's timeout), the
    agents wait at the rendezvous (join_timeout, 600 s by default) and the group re-forms once the
    link is back. The bound itself: test_a_link_cut_past_the_bound_... (a shorter join_timeout)."""
    ckpt = tmp_path / "ckpt"
    nodes = [node(bed, h, ckpt, "cut", "dist.timeout_s=20") for h in bed.names]
    nodes[0].when(r"epoch 3/12 step 4/")
    t_cut = time.time()
    bed.cut("node1")
    caught = [n.when(r"no training progress|Timed out|timed out|hung", after=t_cut, timeout=90) for n in nodes]
    print(
        f"cut link: caught on node0 {caught[0] - t_cut:.1f} s, on node1 {caught[1] - t_cut:.1f} s after the cut "
        f"(dist.hang_timeout_s=10, dist.timeout_s=20)"
    )
    assert max(caught) - t_cut < 20 + 30  # within dist.timeout_s and a margin: no rank hangs past it
    time.sleep(max(0.0, t_cut + CUT_S - time.time()))  # duration: the cut lasts CUT_S
    assert all(n.proc.poll() is None for n in nodes), [n.out[-2000:] for n in nodes]  # still there, waiting
    t_mend = time.time()
    bed.mend("node1")
    # TCP resends on the cut connections back off up to 120 s apart: the first may come that late
    t_back = nodes[0].when(r"epoch \d+/12 step \d+/", after=nodes[0].when("resuming from", after=t_mend, timeout=240))
    print(f"cut link: {CUT_S} s down; training again {t_back - t_mend:.1f} s after the link came back")
    both_finish(nodes)
    assert same(weights(newest(ckpt)), reference)


def test_after_a_cut_ridden_out_a_blocked_read_is_caught_within_the_setting(bed, tmp_path):
    """A cut shorter than the bound is ridden out without a restart; it is a stall, so it raises
    no bound: a read that then blocks on node1 is caught by its watchdog within dist.hang_timeout_s
    (10 x the stall, about 150 s, before), with its stacks, and node0 names it."""
    ckpt = tmp_path / "ckpt"
    hang = 30
    job = [f"dist.hang_timeout_s={hang}", "dist.timeout_s=120", "train.epochs=16"]
    nodes = [
        node(bed, h, ckpt, "stall", *job, environ={"TRAINER_FAULT": "batch@150:sleep=600", "TRAINER_FAULT_RANK": "1"})
        for h in bed.names
    ]
    nodes[0].when(r"epoch 3/16 step 8/")  # near a save: a stall in or after a save counts too
    bed.cut("node1")
    # TCP resends at 0.2 s doubling: a keep-alive sent as the cut begins gets through 3.0 s later
    # after a 2.5 s cut (6.2 s after a 5 s one), and the rendezvous drops a node whose keep-alive is
    # 15 s old (one sent every 5 s): at most about 8 s old here, which leaves 7 s for a loaded
    # machine's delays (a 5 s cut left 4 s, and CI once saw node1 dropped; issue 49)
    time.sleep(2.5)  # duration: of the cut
    bed.mend("node1")
    t_read = nodes[0].when(r"epoch 9/16 step 4/", timeout=120)  # step 132: ridden out, no restart
    assert "resuming from" not in nodes[0].out and re.search(
        r"\(\d+m\d+s stalled waiting for data or other ranks, not counted in img/s\)", nodes[0].out
    ), nodes[0].out[-2000:]
    caught = nodes[1].when(r"rank 1 \(node1\): no training progress", after=t_read, timeout=hang + 60)
    print(
        f"cut ridden out, then a blocked read: caught {caught - t_read:.1f} s after step 132 "
        f"(dist.hang_timeout_s={hang}; the read blocks at step 150)"
    )
    assert caught - t_read < hang + 20
    assert "blocked in its own data read" in nodes[1].out and "crash_point" in (ckpt / "hang-rank1.txt").read_text()
    # node0 reads node1's note on its next check
    nodes[0].when(r"waiting for rank 1 \(node1\), blocked in its data read", after=t_read, timeout=30)
    both_finish(nodes)


def test_a_link_cut_past_the_bound_ends_with_a_crash_code_and_the_relaunch_resumes(bed, tmp_path, reference):
    """The bound is the rendezvous' join_timeout (here 20 s instead of 600 s, to keep CI short): past it
    the first node's agent gives up, the other's supervisor ends its agent if it still waits on the
    store (torchrun would for ever), both with a crash code the scheduler retries; the retry resumes."""
    ckpt = tmp_path / "ckpt"
    nodes = [node(bed, h, ckpt, "cut-long", "dist.timeout_s=20", rdzv="--rdzv-conf=join_timeout=20") for h in bed.names]
    nodes[0].when(r"epoch 3/12 step 4/")
    t_cut = time.time()
    bed.cut("node1")
    codes = [n.wait(150) for n in nodes]
    print(f"cut link past the bound: exits {codes} after {time.time() - t_cut:.1f} s")
    assert all(c not in (0, 2, EXIT_PREEMPTED) for c in codes), [n.out[-2000:] for n in nodes]
    # node1 was in the group: the line names it and says where the job resumes
    assert re.search(
        r"node1, lost .*\(the job resumes from step-\d+\), "
        r"did not come back to the rendezvous at node0:\d+ \(id cut-long\) "
        r"within 20 s",
        nodes[0].out,
    ), nodes[0].out[-2000:]
    assert re.search(
        r"torchrun still waits on the rendezvous at node0:|cannot reach the rendezvous at node0:", nodes[1].out
    ), nodes[1].out[-2000:]
    bed.mend("node1")
    kept = newest(ckpt)
    again = [node(bed, h, ckpt, "cut-long2") for h in bed.names]
    both_finish(again)
    assert f"resuming from {kept}" in again[0].out
    assert same(weights(newest(ckpt)), reference)


# ------------------------------------------------------------------------------------------------
# Elastic: --nnodes 2:3 on three hosts, the rendezvous on a host of its own (as a job that must
# survive the loss of any node has it), a shared checkpoint folder

STORE = """import sys, time, torch.distributed as d
s = d.TCPStore("0.0.0.0", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("ready", flush=True)
time.sleep(3600)
"""
# 48 splits over 2 and 3 processes; 10 steps an epoch; hangs left to the collective timeout, so that a
# node lost silently is seen by the rendezvous' keep-alive, not by the hang watchdog
ELASTIC = ["train.batch_size=48", "train.epochs=50", "dist.hang_timeout_s=100", "dist.timeout_s=200"]


def first_of(procs: list[Proc], pattern: str, after: float = 0.0, timeout: float = 90) -> tuple[Proc, float]:
    """The process (of several hosts) that prints a line matching ``pattern`` first, and when."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [(t, p) for p in procs for t, line in list(p.lines) if t >= after and re.search(pattern, line)]
        if found:
            t, p = min(found, key=lambda x: x[0])
            return p, t
        time.sleep(0.1)
    raise AssertionError(f"no host printed {pattern!r}\n" + "\n".join(f"{p.host}: {p.out[-1500:]}" for p in procs))


def lose_rank0(
    bed: Bed, run: dict[str, Proc], epochs: int, silently: bool = False
) -> tuple[str, list[str], float, float]:
    """Crash the host of rank 0 (whose run printed the start line at world size 3), ``silently``: its
    cable cut first, so that no connection is closed. (That host, the others, when, seconds until
    they train at world size 2.)"""
    rank0 = next(h for h, p in run.items() if "strategy ddp x3" in p.out)
    others = [h for h in run if h != rank0]
    t_loss = time.time()
    if silently:
        bed.cut(rank0)
    bed.crash(rank0)
    leader, t_formed = first_of([run[h] for h in others], "strategy ddp x2", after=t_loss, timeout=90)
    return rank0, others, t_loss, leader.when(rf"epoch \d+/{epochs} step \d+/", after=t_formed) - t_loss


def survivors_name_the_loss(run: dict[str, Proc], others: list[str], rank0: str) -> int:
    """Every survivor says which rank it lost, and one names rank 0 on its host. Under CI's load the
    other may name the other survivor, whose worker left first without a note (the peer of its
    broken connection). Returns the step at which rank 0 was lost, as that survivor said."""
    said = [re.search(r"lost rank (\d+) \((\S+)\) at step (\d+)", run[h].out) for h in others]
    assert all(said) and any(m.groups()[:2] == ("0", rank0) for m in said), [run[h].out[-3000:] for h in others]
    return next(int(m.group(3)) for m in said if m.groups()[:2] == ("0", rank0))


def rejoin(run: dict[str, Proc], host: str, start, epochs: int) -> float:
    """``host`` back (``start()``: the same command): seconds from its launch to training at world size 3."""
    t_back = time.time()
    run[host] = start()
    leader, t_formed = first_of(list(run.values()), "strategy ddp x3", after=t_back, timeout=90)
    return leader.when(rf"epoch \d+/{epochs} step \d+/", after=t_formed) - t_back


def starts(ckpt: Path) -> list[dict]:
    return [
        r
        for r in (json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines())
        if r.get("event") == "start"
    ]


def test_an_elastic_job_goes_on_without_the_host_of_rank_0_and_grows_back_when_it_returns(tmp_path):
    """The host of rank 0 is lost and never comes back in time: the two others re-form at world
    size 2 from the newest checkpoint (its lock taken over) within 30 s on an idle bed (45 s under
    CI's load), with the launchers' defaults; when the host returns, the group grows back to 3 at the step it was on (a
    save at the
    re-form: no step lost). Then a node is lost silently (its cable cut): no error reaches the
    others, whose workers wait in a collective; the rendezvous' keep-alive shows it gone within 60 s
    and the group re-forms without it. When its link is back, that node says it was the one cut
    off (not that the others left); then its power goes. The global batch never changes, so
    every step trains the batch it would have trained straight; the accuracy ends as a
    one-process run's does."""
    ckpt = tmp_path / "ckpt"
    with Bed(4, names=["rdzv", "node0", "node1", "node2"]) as bed:
        store = Proc(bed, "rdzv", [sys.executable, "-c", STORE, str(PORT)], env())
        store.when("ready", timeout=60)
        run = {
            h: node(bed, h, ckpt, "el", *ELASTIC, nnodes="2:3", endpoint="rdzv") for h in ("node0", "node1", "node2")
        }
        first = run["node0"].when(r"epoch 3/50 step 4/", timeout=120)
        rank0, others, t_loss, went_on = lose_rank0(bed, run, 50)
        print(
            f"elastic 2:3: {rank0} (rank 0's host) lost at {t_loss - first:.0f} s -> training at world size 2 "
            f"{went_on:.1f} s later"
        )
        # 17.5-20.5 s on an idle 2-core machine (the 30 s bound), 21.2 and 31.7 s in CI runs beside
        # two other multi-host tests: the bound here is what holds under that load
        assert went_on < 45
        for h in others:
            assert re.search(rf"torchrun: the group re-formed with 2 node\(s\) \(.*; {rank0} left\)", run[h].out), run[
                h
            ].out[-3000:]
        # the one that said it may be cut off later: its output goes
        lost_at = survivors_name_the_loss(run, others, rank0)
        time.sleep(3)  # duration: the host stays away
        back_s = rejoin(run, rank0, lambda: node(bed, rank0, ckpt, "el", *ELASTIC, nnodes="2:3", endpoint="rdzv"), 50)
        print(f"elastic 2:3: {rank0} back -> training at world size 3 {back_s:.1f} s after its launch")
        quiet = others[1]
        t_cut = time.time()
        bed.cut(quiet)  # nothing it sends gets out: the others hear nothing, not even a reset
        kept = [h for h in run if h != quiet]
        said = first_of(
            [run[h] for h in kept], rf"torchrun: {quiet} dropped out of the rendezvous", after=t_cut, timeout=90
        )[1]
        leader, t_formed = first_of([run[h] for h in kept], "strategy ddp x2", after=t_cut, timeout=60)
        t_again = leader.when(r"epoch \d+/50 step \d+/", after=t_formed)
        print(
            f"elastic 2:3: {quiet} lost silently -> noticed {said - t_cut:.1f} s, training at world size 2 "
            f"{t_again - t_cut:.1f} s after the cut"
        )
        assert said - t_cut < 60
        t_mend = time.time()
        bed.mend(quiet)  # the link is back: the node that was cut off says so, not that the others left
        t_self = run[quiet].when(rf"torchrun: this node \({quiet}\) was cut off", after=t_mend, timeout=90)
        bed.crash(quiet)  # then its power goes: the others go on at 2
        print(f"elastic 2:3: {quiet}'s link back -> it said it was cut off {t_self - t_mend:.1f} s later")
        del run[quiet]
        for p in run.values():
            assert p.wait(300) == 0, f"{p.host} exited {p.proc.returncode}\n{p.out[-3000:]}"
        out = "".join(p.out for p in run.values())
        assert f"{rank0} joined" in out and "stopped by torchrun for a re-form of the group at step" in out, out[-3000:]
    grown = int(re.search(r"stopped by torchrun for a re-form of the group at step (\d+)", out).group(1))
    sizes = [(r["world_size"], r["step"]) for r in starts(ckpt)]
    # the grow resumed the step it stopped at
    assert [w for w, _ in sizes] == [3, 2, 3, 2] and sizes[2][1] == grown, sizes
    # the newest save before the loss: every 8 steps and at each epoch's end (10 steps of 48 images)
    assert lost_at - 8 < sizes[1][1] <= lost_at and (sizes[1][1] % 8 == 0 or sizes[1][1] % 10 == 0), (lost_at, sizes)
    assert newest(ckpt).name == "step-500"
    straight = tmp_path / "straight"
    subprocess.run(
        [sys.executable, "-m", "trainer", "train", *JOB, *ELASTIC, f"checkpoint.dir={straight}"],
        check=True,
        cwd=ROOT,
        env=env(),
        capture_output=True,
        timeout=300,
    )
    acc = [
        json.loads(x)["test_acc"] for x in (ckpt / "metrics.jsonl").read_text().splitlines() if '"event": "epoch"' in x
    ][-1]
    ref = [
        json.loads(x)["test_acc"]
        for x in (straight / "metrics.jsonl").read_text().splitlines()
        if '"event": "epoch"' in x
    ][-1]
    assert abs(acc - ref) <= 0.05, (acc, ref)


def test_with_etcd_the_loss_of_rank_0s_host_is_survived_like_any_other_and_the_group_grows_back(tmp_path):
    """k8s/elastic-etcd as the operator and the kubelet would run it, each pod a host of the bed
    named as the pod, the etcd Service's name resolving to the etcd pod's host. etcd runs its
    Deployment's command (Debian's etcd-server), the workers their container's arguments
    (--rdzv-backend=etcd-v2 at the Service). The host of rank 0, which also holds the workers'
    store, is lost silently: its cable cut, then its power gone, so no connection is closed and
    the survivors' workers wait in a collective. Their torchrun notices that its etcd keep-alive
    expired, names the host in one line, stops the workers, and the two go on at world size 2
    (c10d's rendezvous on that host would have ended the job); no line names a live rank as lost.
    The host returns and the group grows back to 3; the job finishes."""
    from test_launchers import local_command

    # Steps of at least 0.4 s: the 270-odd steps left after the loss outlast the returning pod's
    # launch and re-form (rejoin allows it 90 s), whatever the machine's speed. Without a floor, a
    # loaded CI machine once saw the two survivors finish before the pod got back in.
    job = PyTorchJob(
        tmp_path, *TINY, *ELASTIC, "train.epochs=30", folder="elastic-etcd", pods=3, environ=slow_steps(0.4)
    )
    deployment = next(d for d in job.docs if d["kind"] == "Deployment")
    service = next(d for d in job.docs if d["kind"] == "Service")
    etcd_pod = service["metadata"]["name"]
    args = job.specs["Worker"]["template"]["spec"]["containers"][0]["args"]
    assert (
        f"--rdzv-endpoint={etcd_pod}:{service['spec']['ports'][0]['port']}" in args and "--rdzv-backend=etcd-v2" in args
    )
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    with Bed(4, names=[etcd_pod, *job.pods]) as bed:
        etcd = Proc(bed, etcd_pod, local_command(container, {}, {"/var/lib/etcd": tmp_path / "etcd-data"}, []), env())
        etcd.when("ready to serve client requests", timeout=60)
        run = {pod: job.start(bed, pod) for pod in job.pods}
        first = first_of(list(run.values()), r"epoch 3/30 step 4/", timeout=180)[1]
        rank0, others, t_loss, went_on = lose_rank0(bed, run, 30, silently=True)
        said = first_of(
            [run[h] for h in others], rf"torchrun: {rank0} dropped out of the rendezvous", after=t_loss, timeout=5
        )[1]
        print(
            f"etcd, elastic 2:3: {rank0} (rank 0's host) cut, then its power gone, at {t_loss - first:.0f} s -> "
            f"named {said - t_loss:.1f} s later, training at world size 2 {went_on:.1f} s later"
        )
        # etcd-v2 drops the node when its keep-alive key expires (a 10 s TTL, renewed every 5 s, fixed
        # in torch); the reporter reads the keys every 5 s and names a node missing at two reads
        assert went_on < 60
        survivors = "".join(run[h].out for h in others)
        assert "never reported" not in survivors and not re.search(r"lost rank [12] ", survivors), survivors[-3000:]
        bed.mend(rank0)
        back_s = rejoin(run, rank0, lambda: job.start(bed, rank0), 30)  # the pod is back, the same command
        print(f"etcd, elastic 2:3: {rank0} back -> training at world size 3 {back_s:.1f} s after its launch")
        for p in run.values():
            assert p.wait(300) == 0, f"{p.host} exited {p.proc.returncode}\n{p.out[-3000:]}"
    ckpt = job.paths["/checkpoints"] / job.name
    sizes = [r["world_size"] for r in starts(ckpt)]
    assert sizes == [3, 2, 3] and newest(ckpt).name == "step-300", (sizes, newest(ckpt))


# ------------------------------------------------------------------------------------------------
# A PyTorchJob across hosts: the operator's part played (tests/test_launchers.py), each pod on a
# host of its own named as the pod, MASTER_ADDR the master's Service name resolving to its host


class PyTorchJob:
    """k8s/multi-node's PyTorchJob, admitted, its pods started as the operator and the kubelet would:
    the injected environment, init containers, then the pytorch container's command, each pod a host
    of the bed named as the pod (the Service name resolves there)."""

    def __init__(
        self,
        tmp_path: Path,
        *overrides: str,
        folder: str = "multi-node",
        pods: int | None = None,
        environ: dict[str, str] | None = None,
    ):
        from test_launchers import admit, manifests

        self.docs = manifests(folder)
        self.job = next(d for d in self.docs if d["kind"] == "PyTorchJob")
        self.job["spec"]["nprocPerNode"] = "1"  # one CPU process per pod on this machine
        self.name, self.specs = self.job["metadata"]["name"], self.job["spec"]["pytorchReplicaSpecs"]
        if pods is not None:  # an elastic job of fewer pods: the range one below them to the pods (3 -> 2:3)
            self.specs["Worker"]["replicas"] = self.job["spec"]["elasticPolicy"]["maxReplicas"] = pods
            self.job["spec"]["elasticPolicy"]["minReplicas"] = pods - 1
        admit(self.job)
        self.paths = {"/checkpoints": tmp_path / "checkpoints", "/data": tmp_path / "data"}
        for p in self.paths.values():
            p.mkdir(exist_ok=True)
        self.pods = {
            f"{self.name}-{role.lower()}-{i}": (role, i)
            for role, spec in self.specs.items()
            for i in range(spec.get("replicas", 1))
        }
        self.master, self.worker = f"{self.name}-master-0", f"{self.name}-worker-0"
        self.extra = ["checkpoint.every_steps=8", "checkpoint.keep=50", "dist.hang_timeout_s=10", *overrides]
        self.environ = environ or {}

    def start(self, bed: Bed, pod: str) -> Proc:
        from test_launchers import TINY_JOB, local_command, operator_env

        role, i = self.pods[pod]
        template, variables = self.specs[role]["template"]["spec"], operator_env(self.job, role, i)
        # resolved on every host, as the headless Service is
        assert variables.get("MASTER_ADDR", self.master) == self.master
        pod_env = env(**variables)
        for init in template.get("initContainers", []):
            assert (
                bed.run(
                    pod, local_command(init, variables, self.paths, TINY_JOB), env=pod_env, cwd=ROOT, timeout=120
                ).returncode
                == 0
            )
        c = next(c for c in template["containers"] if c["name"] == "pytorch")
        pod_env.update({**{e["name"]: e["value"] for e in c.get("env", [])}, **self.environ})
        return Proc(bed, pod, local_command(c, variables, self.paths, [*TINY_JOB, *self.extra]), pod_env)


def test_pytorchjob_pods_on_two_hosts_train_and_a_lost_worker_pod_is_replaced_by_the_operator(tmp_path):
    """The worker pod's container dies with everything in it (137: retryable under the ExitCode
    policy): the operator deletes the pod and makes it again, same name, and the job resumes."""
    job = PyTorchJob(tmp_path, "train.epochs=24")
    assert job.specs["Worker"]["restartPolicy"] == "ExitCode"
    with Bed(len(job.pods), names=list(job.pods)) as bed:
        running = {pod: job.start(bed, pod) for pod in job.pods}
        running[job.master].when(r"epoch 4/24 step 8/")
        t_crash = time.time()
        bed.crash(job.worker)  # the worker's container dies with everything in it
        # duration: the pod is away while the operator deletes it and makes it again (same name, its host here)
        time.sleep(5)
        running[job.worker] = job.start(bed, job.worker)
        t_back = running[job.master].when(
            r"epoch \d+/24 step \d+/", after=running[job.master].when("resuming from", after=t_crash)
        )
        print(
            f"PyTorchJob: worker pod lost -> the master's next training step {t_back - t_crash:.1f} s later (5 s of "
            f"it the pod was down)"
        )
        both_finish(list(running.values()))
        assert "strategy ddp x2" in running[job.master].out and "done: step 384" in running[job.master].out
    assert (job.paths["/checkpoints"] / job.name / "step-384" / "meta.json").is_file()


def test_pytorchjob_pods_deleted_save_once_exit_75_and_the_new_pods_resume(tmp_path):
    """Deleting the pods (a drain, a preemption, kubectl delete): the kubelet sends SIGTERM to each
    container's first process and waits terminationGracePeriodSeconds; each saves and exits 203 (75
    moved into the ExitCode policy's retried range); the new pods resume."""
    job = PyTorchJob(tmp_path, "train.epochs=12")
    grace = {
        role: spec["template"]["spec"].get("terminationGracePeriodSeconds", 30) for role, spec in job.specs.items()
    }
    with Bed(len(job.pods), names=list(job.pods)) as bed:
        running = {pod: job.start(bed, pod) for pod in job.pods}
        running[job.master].when(r"epoch 3/12 step 8/")
        t_term = time.time()
        for p in running.values():
            p.proc.send_signal(signal.SIGTERM)
        codes = {pod: p.wait(max(grace.values())) for pod, p in running.items()}
        print(
            f"PyTorchJob pods deleted: exits {list(codes.values())} {time.time() - t_term:.1f} s after SIGTERM (grace "
            f"{grace})"
        )
        assert set(codes.values()) == {128 + EXIT_PREEMPTED}, {pod: p.out[-2000:] for pod, p in running.items()}
        stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint saved", running[job.master].out)
        assert stopped, running[job.master].out[-2000:]
        again = {pod: job.start(bed, pod) for pod in job.pods}  # the operator makes the pods again
        both_finish(list(again.values()))
        assert f"resuming from /checkpoints/{job.name}/step-{stopped.group(1)}" in again[job.master].out.replace(
            str(tmp_path), ""
        )
        assert "done: step 192" in again[job.master].out


def test_a_streamed_epoch_stays_exact_when_an_elastic_job_grows(bed, tmp_path):
    """Your own images, streamed from shards on a shared folder, under --nnodes 1:2: node0 trains
    alone, node1 joins mid-epoch, the group re-forms at world size 2 from the save at the re-form.
    Every image of each epoch trains exactly once, in the global batches of a one-process run
    (per-sample ids of every rank and attempt)."""
    from conftest import make_jpegs, slow_steps

    from trainer.worker.data.shards import write

    write(make_jpegs(tmp_path / "img", train=12, test=3), tmp_path / "sh")  # 120 images: 10 steps of 12
    job = [
        "data.name=shards",
        f"data.dir={tmp_path / 'sh'}",
        "data.loader=stream",
        "data.image_size=32",
        "data.stream_workers=1",
        "train.batch_size=12",
        "train.epochs=3",
        "checkpoint.every_steps=0",
        "checkpoint.every_epochs=1",
    ]
    traces, ckpt = tmp_path / "traces", tmp_path / "ckpt"
    traces.mkdir()
    first = node(
        bed, "node0", ckpt, "s", *job, nnodes="1:2", environ={"TRAINER_SAMPLE_TRACE": str(traces), **slow_steps(0.3)}
    )
    first.when(r"epoch 1/3 step 4/10", timeout=120)
    second = node(
        bed, "node1", ckpt, "s", *job, nnodes="1:2", environ={"TRAINER_SAMPLE_TRACE": str(traces), **slow_steps(0.3)}
    )
    both_finish([first, second])
    assert "stopped by torchrun for a re-form of the group at step" in first.out and "strategy ddp x2" in first.out, (
        first.out[-3000:]
    )
    assert [r["world_size"] for r in starts(ckpt)] == [1, 2]
    steps: dict[tuple[int, int], list[int]] = {}
    for f in traces.glob("samples-rank*.txt"):
        for line in f.read_text().splitlines():
            epoch, step, *ids = map(int, line.split())
            steps.setdefault((epoch, step), []).extend(ids)
    from trainer.worker.data.loader import epoch_order

    assert sorted(steps) == [(e, s) for e in range(3) for s in range(10)]
    for (epoch, step), ids in steps.items():  # the one-process order: global batch k, whatever the world size
        assert sorted(ids) == sorted(epoch_order(120, 0, epoch)[step * 12 : (step + 1) * 12].tolist()), (epoch, step)
