"""Slurm for real across hosts (tests/hosts.py: slurmctld on a host of its own, one slurmd per node
host, the machine's munged): `sbatch slurm/ddp.sh` on two nodes, an elastic job that loses a node,
a lost node, preemption by a higher partition, and TorchX's Slurm jobs at their time limit and
preempted. Needs root and Slurm (CI runs as root; tests/slurm/start-cluster.sh starts munged)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, env, slow_steps
from hosts import Bed, SlurmCluster

pytestmark = pytest.mark.slow


@pytest.fixture
def slurm(tmp_path):
    assert shutil.which("slurmd") and subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0, (
        "Slurm and munged are needed: tests/slurm/start-cluster.sh (as .ci/run does)"
    )
    with Bed(3, decoy=True, names=["ctl", "node0", "node1"]) as b:
        yield SlurmCluster(b, cpus=os.cpu_count() or 2)
    assert not b.leftovers()


def sbatch(cluster: SlurmCluster, tmp: Path, run_name: str, *overrides: str, environ: dict | None = None) -> str:
    env = {
        "NPROC_PER_NODE": "1",
        "CONFIG": "configs/smoke.yaml",
        "RUN_NAME": run_name,
        "SHARED_DIR": str(tmp),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        **(environ or {}),
    }
    p = cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--gpus-per-node=0",
        f"--cpus-per-task={os.cpu_count() or 2}",
        f"--output={tmp}/slurm-%j.out",
        "slurm/ddp.sh",
        "train.plot=false",
        "train.log_every=4",
        "dist.hang_timeout_s=20",
        *overrides,
        env=env,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().split(";")[0]


def wait_for(cluster: SlurmCluster, job: str, states=("COMPLETED", "FAILED", "CANCELLED"), timeout: float = 300) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = cluster.job_field(job, "JobState")
        if state in states:
            return state
        time.sleep(0.5)
    return cluster.job_field(job, "JobState")


def test_sbatch_on_two_nodes_trains_across_them_and_advertises_a_reachable_address(slurm, tmp_path):
    job = sbatch(slurm, tmp_path, "two", "train.epochs=2")
    state, out = wait_for(slurm, job), (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED" and slurm.job_field(job, "NodeList") == "node[0-1]", out
    assert "strategy ddp x2" in out and "done: step 64" in out, out
    for host in ("node0", "node1"):  # the route to the first node, not the decoy listed first by hostname -I
        assert f"{host}: rendezvous at node0:" in out and f"this node advertises {slurm.bed.addr[host]}" in out, out
    assert slurm.bed.decoy_addr["node1"] not in out


def test_an_elastic_slurm_job_goes_on_without_a_failed_node(tmp_path):
    """MIN_NODES=2 sbatch --no-kill --nodes=3 slurm/ddp.sh: a node of the three fails (slurmd and
    the job's processes killed, never back); the allocation and the step live on, the two others
    re-form from the newest checkpoint and the job COMPLETES there, never requeued."""
    assert shutil.which("slurmd") and subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0, (
        "Slurm and munged are needed: tests/slurm/start-cluster.sh (as .ci/run does)"
    )
    with Bed(4, names=["ctl", "node0", "node1", "node2"]) as bed:
        cluster = SlurmCluster(bed, cpus=os.cpu_count() or 2)
        env_ = {
            "NPROC_PER_NODE": "1",
            "CONFIG": "configs/smoke.yaml",
            "RUN_NAME": "el",
            "SHARED_DIR": str(tmp_path),
            "OMP_NUM_THREADS": "1",
            "MIN_NODES": "2",
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        }
        p = cluster.run(
            "sbatch",
            "--parsable",
            "--no-kill",
            "--nodes=3",
            "--gpus-per-node=0",
            f"--cpus-per-task={os.cpu_count() or 2}",
            f"--output={tmp_path}/slurm-%j.out",
            "slurm/ddp.sh",
            "train.plot=false",
            "train.log_every=4",
            "train.batch_size=48",
            "train.epochs=12",
            "checkpoint.every_steps=8",
            "dist.hang_timeout_s=60",
            env=env_,
            cwd=ROOT,
        )
        assert p.returncode == 0, p.stderr
        job = p.stdout.strip().split(";")[0]
        metrics = tmp_path / "checkpoints" / "el" / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and not (
            metrics.exists() and metrics.read_text().count('"event": "checkpoint"') >= 2
        ):
            time.sleep(0.5)
        t_crash = time.time()
        bed.crash("node2")
        state = wait_for(cluster, job, timeout=400)
        out = (tmp_path / f"slurm-{job}.out").read_text()
        assert state == "COMPLETED" and cluster.job_field(job, "Restarts") == "0", f"{state}\n{out[-4000:]}"
        assert re.search(r"the group re-formed with 2 node\(s\) \(.*; node2 left\)", out) and "done: step" in out, out[
            -4000:
        ]
        records = [json.loads(x) for x in metrics.read_text().splitlines()]
        shrunk = next(r for r in records if r.get("event") == "start" and r.get("world_size") == 2)
        t_next = next(r["time"] for r in records[records.index(shrunk) :] if r.get("event") == "log")
        print(
            f"elastic Slurm job: node2 lost -> training at world size 2 {t_next - t_crash:.1f} s later; COMPLETED "
            f"without a requeue"
        )
    assert not bed.leftovers()


def test_a_lost_slurm_node_requeues_the_job_and_it_resumes_when_the_node_is_back(slurm, tmp_path):
    job = sbatch(slurm, tmp_path, "lost", "train.epochs=8", "checkpoint.every_steps=16", environ=slow_steps(0.05))
    metrics = tmp_path / "checkpoints" / "lost" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count('"event": "checkpoint"') >= 2):
        time.sleep(0.5)
    t_crash = time.time()
    slurm.bed.crash("node1")  # slurmd and the job's processes on it, at once
    deadline = time.time() + 120
    while time.time() < deadline and slurm.states().get("node1", "").rstrip("*") not in ("down", "idle"):
        time.sleep(0.5)
    t_down = time.time()
    time.sleep(3)  # duration: the node is down
    slurm.start_node("node1")  # the node reboots and its slurmd registers again
    assert wait_for(slurm, job, timeout=400) == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()[-4000:]
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert int(slurm.job_field(job, "Restarts")) >= 1 and "resuming from" in out and "done: step 256" in out, out[
        -3000:
    ]
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    resumed = next(i for i, r in enumerate(records) if r.get("event") == "start" and r.get("resumed_from"))
    t_next = next(r["time"] for r in records[resumed:] if r.get("event") == "log")
    print(
        f"lost Slurm node: marked down {t_down - t_crash:.0f} s after the crash; first training step after the requeue "
        f"{t_next - t_crash:.0f} s after the crash (the node back {t_down + 3 - t_crash:.0f} s after it)"
    )


def preempt_once_training(cluster: SlurmCluster, tmp: Path, metrics: Path) -> None:
    """Once the run writing ``metrics`` logs a training line, a job of the ``urgent`` partition takes
    both nodes (preempting ours) and finishes."""
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.exists() and '"event": "log"' in metrics.read_text()):
        time.sleep(0.5)
    urgent = cluster.run(
        "sbatch",
        "--parsable",
        "--partition=urgent",
        "--nodes=2",
        f"--cpus-per-task={os.cpu_count() or 2}",
        f"--output={tmp}/urgent-%j.out",
        "--wrap",
        "sleep 2",
        cwd=tmp,
    )
    assert urgent.returncode == 0, urgent.stderr
    assert wait_for(cluster, urgent.stdout.strip(), timeout=180) == "COMPLETED"


def test_slurm_preemption_stops_both_nodes_with_75_and_the_requeued_job_resumes(slurm, tmp_path):
    """A job of a higher partition takes both nodes: Slurm signals every step of ours (SIGTERM, with
    GraceTime), requeues the job, and starts it again once the nodes are free."""
    job = sbatch(slurm, tmp_path, "pre", "train.epochs=8", "checkpoint.every_steps=16", environ=slow_steps(0.05))
    metrics = tmp_path / "checkpoints" / "pre" / "metrics.jsonl"
    preempt_once_training(slurm, tmp_path, metrics)
    assert wait_for(slurm, job, timeout=400) == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()[-4000:]
    out = (tmp_path / f"slurm-{job}.out").read_text()
    # each node's
    assert len(re.findall(r"stopped by SIGTERM; exit 75 \(run the same command to resume from step-\d+\)", out)) == 2, (
        out[-4000:]
    )
    stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint saved", out)
    assert stopped and int(slurm.job_field(job, "Restarts")) >= 1, out[-4000:]
    assert f"resuming from {tmp_path}/checkpoints/pre/step-{stopped.group(1)}" in out and "done: step 256" in out, out[
        -4000:
    ]


def test_a_two_node_torchx_job_saves_before_its_time_limit_requeues_itself_and_resumes(slurm, tmp_path):
    """`torchx run -s slurm --j 2x1`: a heterogeneous job, a component per node, whose squeue time
    left has a line per component. Its 2-minute limit, 95 s of margin: both nodes stop, save, one
    of them requeues the job before srun's --kill-on-bad-exit ends the other, and the requeued job
    resumes from that save."""
    from test_slurm import saved_before_first_resume, starts, torchx_job_id, torchx_slurm_cmd

    cmd = torchx_slurm_cmd(tmp_path, "train.epochs=2000", nproc=1, nnodes=2)
    job = torchx_job_id(slurm.run(*cmd, env=env(**slow_steps(0.05)), cwd=tmp_path, timeout=120))
    try:
        deadline = time.time() + 300
        while time.time() < deadline and len(starts(tmp_path)) < 2:
            time.sleep(1)
        logs = "\n".join(f.read_text()[-3000:] for f in sorted((tmp_path / "job").glob("slurm-*")))
        first, *again = starts(tmp_path)
        assert first == 0 and again, logs
        saved = saved_before_first_resume(tmp_path)
        assert again[0] == saved[-1] > 0, (again, saved, logs)  # resumed from the save made before the time limit
        assert int(slurm.job_field(job, "Restarts")) >= 1
    finally:
        slurm.run("scancel", job)


@pytest.mark.parametrize(
    "supervised, nnodes", [(True, 1), (False, 1), (True, 2)], ids=["supervised", "control", "supervised-2-nodes"]
)
def test_a_preempted_torchx_job_saves_requeues_itself_and_resumes(slurm, tmp_path, supervised, nnodes):
    """TorchX's sbatch script (torchx 0.7) asks for no requeue of its own when --max_retries is 0;
    Slurm's preemption SIGTERMs the step and ends the job FAILED once its srun exits 75 within the
    grace time (the control: the component's TRAINER_SLURM_SUPERVISE switched off). Supervised, the
    job saves, finds its PreemptTime, requeues itself and resumes from that save when the nodes are
    free again."""
    from test_slurm import records, saved_before_first_resume, starts, torchx_job_id, torchx_slurm_cmd

    cmd = torchx_slurm_cmd(
        tmp_path, "train.epochs=8", "checkpoint.every_steps=16", minutes=None, nproc=1, nnodes=nnodes
    )
    if not supervised:
        i = cmd.index("--env") + 1
        cmd[i] += ",TRAINER_SLURM_SUPERVISE=0"
    # torchx writes .torchxslurmjobdirs here
    job = torchx_job_id(slurm.run(*cmd, env=env(**slow_steps(0.05)), cwd=tmp_path, timeout=120))
    metrics = tmp_path / "ck" / "run" / "metrics.jsonl"
    preempt_once_training(slurm, tmp_path, metrics)
    state = wait_for(slurm, job, timeout=400)
    logs = "\n".join(f.read_text()[-3000:] for f in sorted((tmp_path / "job").glob("slurm-*")))
    rows, saved = records(tmp_path), saved_before_first_resume(tmp_path)
    if not supervised:  # stopped and saved (exit 75), but never requeued
        assert state == "FAILED" and slurm.job_field(job, "Restarts") == "0" and starts(tmp_path) == [0], (
            f"{state}\n{logs}"
        )
        assert "exited with code 75" in logs and saved, logs
        return
    # the requeued run's log replaced the first's
    assert state == "COMPLETED" and int(slurm.job_field(job, "Restarts")) >= 1, f"{state}\n{logs}"
    first, *again = starts(tmp_path)
    assert first == 0 and again == [saved[-1]], (again, saved)  # resumed from the save the preemption made
    assert rows[-1].get("event") != "start" and any(r.get("event") == "epoch" and r.get("epoch") == 8 for r in rows), (
        rows[-3:]
    )
