"""What a worker says when it fails (trainer/worker/crash.py): one line naming the lost rank and host, the
step and what happens next; the traceback in the run folder. Real processes, real gloo, real torchrun."""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import ROOT, TINY, env, free_port, trainer_cmd

from trainer.worker import crash

HOSTS = [("node0", ["10.9.0.10"]), ("node1", ["10.9.0.11"]), ("node2", ["10.9.0.12", "10.9.1.12"])]


def test_a_gloo_error_names_the_rank_and_host_it_lost(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    error = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.9.1.12]:40567: Connection reset by peer"
    )
    line = crash.describe(error, 0, 57, HOSTS, 300)
    assert line.endswith("lost rank 2 (node2) at step 57: Read error [10.9.1.12]:40567: Connection reset by peer"), line
    assert "pair.cc" not in line
    assert (
        crash.what_next(None)
        == "torchrun goes back to its rendezvous to re-form the group from the start (no checkpoint yet) (2 "
        "restart(s) left)"
    )


def test_an_unknown_peer_a_timeout_and_a_bug_each_read_as_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    lost = crash.describe(RuntimeError("Connection closed by peer [10.0.0.99]:1"), 1, 3, HOSTS, 300)
    assert "lost a peer at step 3" in lost
    timeout = crash.describe(
        RuntimeError("[gloo] Timed out waiting 300000ms for recv operation to complete"), 1, 3, HOSTS, 300
    )
    assert "a collective waited dist.timeout_s=300 s" in timeout

    class Silent:  # the watchdog's view of the store: rank 2 noted no failure of its own (its host is gone)
        def note_failure(self):
            return True

        def lost(self, hosts):
            return [(2, hosts[2][0])]

    named = crash.describe(
        RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete"), 1, 3, HOSTS, 30, Silent()
    )
    assert named.startswith("rank 1 (") and named.endswith(
        "): lost rank 2 (node2) at step 3: it did not answer a collective for dist.timeout_s=30 s"
    ), named
    bug = crash.describe(ValueError("bad shape\nmore"), 0, None, HOSTS, 300)
    assert bug.endswith("crashed before the first step: ValueError: more")
    (tmp_path / "step-8").mkdir()
    (tmp_path / "step-8" / "meta.json").write_text("{}")
    assert crash.what_next(tmp_path) == "run the same command to resume from step-8"


def test_torchs_typed_errors_decide_before_the_text(monkeypatch):
    """A DistNetworkError is a lost peer and a DistStoreError a timeout whatever their words; gloo's
    plain RuntimeErrors are told apart by their text (what torch 2.14's gloo raises for both)."""
    import torch.distributed as dist

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert crash.kind(dist.DistNetworkError("the store at node0:29500 went away")) == "lost"
    assert crash.kind(dist.DistStoreError("wait for keys took too long")) == "timeout"
    assert (
        crash.kind(dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"))
        == "timeout"
    )
    assert crash.kind(RuntimeError("Read error [10.9.0.11]:40567: Connection reset by peer")) == "lost"
    assert crash.kind(RuntimeError("Timed out waiting 8000ms for recv operation to complete")) == "timeout"
    # a timeout with no collective and no Dist type
    assert crash.kind(RuntimeError("CUDA out of memory; timed out")) == "other"
    assert "lost a peer at step 4" in crash.describe(dist.DistNetworkError("the store went away"), 1, 4, HOSTS, 300)
    assert "a collective waited dist.timeout_s=300 s" in crash.describe(
        dist.DistStoreError("wait for keys took too long"), 1, 4, HOSTS, 300
    )


@pytest.mark.slow
def test_a_worker_that_loses_its_peer_says_so_in_one_line_and_keeps_the_traceback(tmp_path):
    """Two ranks under torchrun; rank 1 is killed at step 6 (kill -9): rank 0 says in one line whom
    it lost, at which step, and what comes next; no traceback on the console, one in the run folder."""
    ckpt = tmp_path / "ckpt"
    cmd = trainer_cmd(
        "torchrun",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        "-m",
        "trainer",
        "train",
        *TINY,
        "train.epochs=2",
        "checkpoint.every_steps=4",
        f"checkpoint.dir={ckpt}",
    )
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env(TRAINER_FAULT="batch@6:kill", TRAINER_FAULT_RANK="1"),
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    line = [x for x in out.splitlines() if x.startswith("rank 0 (")]
    assert len(line) == 1, out[-3000:]
    assert re.search(r"rank 0 \(\S+\): lost rank 1 \(\S+\) at step 5", line[0]) or re.search(
        r"rank 0 \(\S+\): (lost|a collective)", line[0]
    ), line[0]
    assert "no torchrun restart left: the launcher's retry resumes from step-4" in line[0], line[0]
    assert f"traceback in {ckpt}/error-rank0.txt" in line[0]
    assert "Traceback" not in out.replace("traceback in", "") and "ChildFailedError" not in out, out[-3000:]
    assert "torchrun: no restart left after rank 1 exited -9" in out, out[-3000:]
    assert "Traceback (most recent call last)" in (ckpt / "error-rank0.txt").read_text()
