"""The real batch scripts on a real one-node Slurm (tests/slurm/start-cluster.sh; .ci/run starts it).
CPU and gloo, a tiny config, the GPU request overridden with --gpus-per-node=0."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def sbatch(script: str, tmp: Path, *overrides: str, wait: bool = True, run_name: str = "t", extra_env: dict | None = None) -> str:
    assert shutil.which("sbatch"), "Slurm is not installed: run tests/slurm/start-cluster.sh (as .ci/run does)"
    import os

    env = {**os.environ, "NPROC_PER_NODE": "2" if "ddp" in script else "1", "CONFIG": "configs/smoke.yaml",
           "RUN_NAME": run_name, "SHARED_DIR": str(tmp), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", f"--output={tmp}/slurm-%j.out"]
    cmd += ["--wait"] if wait else []
    p = subprocess.run([*cmd, script, "train.plot=false", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    job = p.stdout.strip().split(";")[0]
    if wait:
        assert p.returncode == 0, f"sbatch exited {p.returncode}: {p.stderr}\n{log(tmp, job)}"
    return job


def log(tmp: Path, job: str) -> str:
    f = tmp / f"slurm-{job}.out"
    return f.read_text() if f.exists() else ""


def job_field(job: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    m = re.search(rf"\b{name}=(\S+)", out)
    return m.group(1) if m else ""


@pytest.mark.parametrize("script, args, shown", [("slurm/ddp.sh", [], "strategy ddp x2"), ("slurm/single.sh", ["train.strategy=cpu"], "strategy cpu x1")])
def test_batch_scripts_train_and_checkpoint(tmp_path, script, args, shown):
    job = sbatch(script, tmp_path, "train.epochs=1", *args)
    assert job_field(job, "JobState") == "COMPLETED" and job_field(job, "ExitCode") == "0:0"
    out = log(tmp_path, job)
    assert "done: step 32" in out and shown in out, out
    assert (tmp_path / "checkpoints" / "t" / "step-32" / "state.pt").is_file()


def test_single_script_on_cpu_strategy_names_the_problem(tmp_path):
    # train.strategy=single on a node without a GPU: a clear error and a failed job, not a hang
    job = sbatch("slurm/single.sh", tmp_path, "train.epochs=1", wait=False)
    for _ in range(120):
        if job_field(job, "JobState") in ("COMPLETED", "FAILED"):
            break
        time.sleep(1)
    assert job_field(job, "JobState") == "FAILED" and job_field(job, "ExitCode") == "2:0"
    assert "needs a CUDA GPU" in log(tmp_path, job) and "torchrun" not in log(tmp_path, job)


def training_job(tmp_path: Path, run_name: str) -> str:
    """A 40-epoch ddp.sh job, returned once it has logged a training step."""
    job = sbatch("slurm/ddp.sh", tmp_path, "train.epochs=40", "train.log_every=4", wait=False, run_name=run_name)
    metrics = tmp_path / "checkpoints" / run_name / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and '"event": "log"' in metrics.read_text()):
        time.sleep(0.5)
    assert metrics.exists(), log(tmp_path, job)
    return job


def test_usr1_before_the_time_limit_checkpoints_requeues_and_resumes(tmp_path):
    job = training_job(tmp_path, "pre")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    # the job checkpoints, exits and requeues itself; it may start again once its credential has
    # expired (AuthInfo=cred_expire=10 in tests/slurm/start-cluster.sh; 120 s by default)
    deadline = time.time() + 240
    while time.time() < deadline and "requeueing" not in log(tmp_path, job):
        time.sleep(0.5)
    assert "requeueing" in log(tmp_path, job), log(tmp_path, job)
    deadline = time.time() + 420
    while time.time() < deadline and job_field(job, "JobState") not in ("COMPLETED", "FAILED", "CANCELLED"):
        time.sleep(1)
    out = log(tmp_path, job)
    assert job_field(job, "JobState") == "COMPLETED", out
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", out)
    assert stopped, out
    assert f"step-{stopped.group(1)}" in out.split("requeueing")[1]  # the next run resumed from that step
    assert "resuming from" in out and "done: step 1280" in out
    assert (tmp_path / "checkpoints" / "pre" / "step-1280").is_dir()


def test_a_plain_sigterm_to_the_job_step_ends_the_job_with_75_and_a_checkpoint(tmp_path):
    """The exit contract at the batch step: scancel --signal=TERM (no time-limit warning, so no
    requeue) -> the workers save, `trainer torchrun` gives 75, srun and the batch script pass it on."""
    job = training_job(tmp_path, "term")
    subprocess.run(["scancel", "--signal=TERM", job], check=True)
    deadline = time.time() + 240
    while time.time() < deadline and job_field(job, "JobState") not in ("COMPLETED", "FAILED", "CANCELLED"):
        time.sleep(1)
    out = log(tmp_path, job)
    assert job_field(job, "JobState") == "FAILED" and job_field(job, "ExitCode") == "75:0", out
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", out)
    assert stopped and (tmp_path / "checkpoints" / "term" / f"step-{stopped.group(1)}" / "state.pt").is_file(), out


def test_the_ddp_script_asks_for_requeue_a_time_limit_and_one_task_per_node(tmp_path):
    """What Slurm itself parsed from slurm/ddp.sh's #SBATCH lines (a held job; nothing runs); the
    USR1 warning is exercised for real by the requeue test above."""
    job = sbatch("slurm/ddp.sh", tmp_path, wait=False, extra_env={"SBATCH_HOLD": "1"})
    try:
        assert job_field(job, "Requeue") == "1" and job_field(job, "TimeLimit") == "04:00:00"
        assert job_field(job, "NumTasks") == "1" and job_field(job, "JobName") == "cifar-ddp"
    finally:
        subprocess.run(["scancel", job])
