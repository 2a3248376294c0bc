"""The real batch scripts on a real one-node Slurm (tests/slurm/start-cluster.sh; .ci/run starts it).
CPU and gloo, a tiny config, the GPU request overridden with --gpus-per-node=0."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, slow_steps

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def sbatch(
    script: str, tmp: Path, *overrides: str, wait: bool = True, run_name: str = "t", extra_env: dict | None = None
) -> str:
    assert shutil.which("sbatch"), "Slurm is not installed: run tests/slurm/start-cluster.sh (as .ci/run does)"
    import os

    env = {
        **os.environ,
        "NPROC_PER_NODE": "2" if "ddp" in script else "1",
        "CONFIG": "configs/smoke.yaml",
        "RUN_NAME": run_name,
        "SHARED_DIR": str(tmp),
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    cmd = [
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--gpus-per-node=0",
        "--cpus-per-task=2",
        f"--output={tmp}/slurm-%j.out",
    ]
    cmd += ["--wait"] if wait else []
    p = subprocess.run(
        [*cmd, script, "train.plot=false", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
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


@pytest.mark.parametrize(
    "script, args, shown",
    [("slurm/ddp.sh", [], "strategy ddp x2"), ("slurm/single.sh", ["train.strategy=cpu"], "strategy cpu x1")],
)
def test_batch_scripts_train_and_checkpoint(tmp_path, script, args, shown):
    job = sbatch(script, tmp_path, "train.epochs=1", *args)
    assert job_field(job, "JobState") == "COMPLETED" and job_field(job, "ExitCode") == "0:0"
    out = log(tmp_path, job)
    assert "done: step 32" in out and shown in out, out
    assert (tmp_path / "checkpoints" / "t" / "step-32" / "meta.json").is_file()


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
    """An 8-epoch ddp.sh job of steps of 50 ms or more (256 of them), returned once it has logged a training step."""
    job = sbatch(
        "slurm/ddp.sh",
        tmp_path,
        "train.epochs=8",
        "train.log_every=4",
        wait=False,
        run_name=run_name,
        extra_env=slow_steps(0.05),
    )
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
    assert "resuming from" in out and "done: step 256" in out
    assert (tmp_path / "checkpoints" / "pre" / "step-256").is_dir()


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
    assert stopped and (tmp_path / "checkpoints" / "term" / f"step-{stopped.group(1)}" / "meta.json").is_file(), out


def test_the_ddp_script_asks_for_requeue_a_time_limit_and_one_task_per_node(tmp_path):
    """What Slurm itself parsed from slurm/ddp.sh's #SBATCH lines (a held job; nothing runs); the
    USR1 warning is exercised for real by the requeue test above."""
    job = sbatch("slurm/ddp.sh", tmp_path, wait=False, extra_env={"SBATCH_HOLD": "1"})
    try:
        assert job_field(job, "Requeue") == "1" and job_field(job, "TimeLimit") == "04:00:00"
        assert job_field(job, "NumTasks") == "1" and job_field(job, "JobName") == "cifar-ddp"
    finally:
        subprocess.run(["scancel", job])


# TorchX's own sbatch script (torchx 0.7): no USR1, a requeue on any failure while --max_retries
# allows, srun without -c. The supervisor looks after the job there (trainer/launch/slurm.py).


def torchx_slurm_cmd(
    tmp: Path,
    *overrides: str,
    max_retries: int = 0,
    margin_s: int = 95,
    minutes: int | None = 2,
    nproc: int = 2,
    nnodes: int = 1,
) -> list[str]:
    """`torchx run -s slurm` of the DDP component (CPU processes): its command line. ``tmp/job`` is
    the job folder (made here), ``tmp/ck/run`` the run's checkpoints. TorchX submits more than one
    node as a heterogeneous job, a component per node."""
    import sys

    (tmp / "job").mkdir()
    time_limit = f"time={minutes}," if minutes else ""
    return [
        str(Path(sys.executable).parent / "torchx"),
        "run",
        "--workspace",
        "",
        "-s",
        "slurm",
        "-cfg",
        f"{time_limit}job_dir={tmp / 'job'}",
        f"{ROOT / 'trainer' / 'launch' / 'components.py'}:train_ddp",
        "--j",
        f"{nnodes}x{nproc}",
        "--gpu",
        "0",
        "--cpu",
        "2",
        "--memMB",
        "1000",
        "--max_retries",
        str(max_retries),
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--checkpoint_mount",
        "",
        "--checkpoint_dir",
        str(tmp / "ck" / "run"),
        "--data_dir",
        str(tmp / "data"),
        "--env",
        f"TRAINER_PYTHON={sys.executable},TRAINER_SLURM_MARGIN_S={margin_s},OMP_NUM_THREADS=1",
        "--",
        "train.plot=false",
        "train.log_every=50",
        *overrides,
    ]


def torchx_job_id(p: subprocess.CompletedProcess) -> str:
    """The Slurm job id of a `torchx run -s slurm`; torchx prints the app handle, then may fail to
    describe the job (these clusters keep no accounting)."""
    m = re.search(r"slurm://torchx/(\d+)", p.stdout + p.stderr)
    assert m, p.stdout + p.stderr
    return m.group(1)


def torchx_slurm(
    tmp: Path, *overrides: str, max_retries: int = 0, margin_s: int = 95, minutes: int = 2, environ: dict | None = None
) -> str:
    """`torchx run -s slurm` on the one-node cluster; its job id. The job's variables: ``environ``
    (sbatch passes the submitter's on; torchx's --env takes no value with '=')."""
    from conftest import env

    cmd = torchx_slurm_cmd(tmp, *overrides, max_retries=max_retries, margin_s=margin_s, minutes=minutes)
    # torchx writes .torchxslurmjobdirs into its working folder
    return torchx_job_id(
        subprocess.run(cmd, cwd=tmp, env=env(**(environ or {})), capture_output=True, text=True, timeout=120)
    )


def records(tmp: Path) -> list[dict]:
    """The metrics.jsonl records of the run in ``tmp/ck/run`` (none before it starts)."""
    metrics = tmp / "ck" / "run" / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def starts(tmp: Path) -> list[int]:
    """The steps at which the run in ``tmp/ck/run`` started (0, then each resume's step)."""
    return [r["step"] for r in records(tmp) if r.get("event") == "start"]


def saved_before_first_resume(tmp: Path) -> list[int]:
    """The steps the run's first start saved checkpoints at (all of them when it never resumed)."""
    rows = records(tmp)
    events = [r.get("event") for r in rows]
    end = events.index("start", 1) if events.count("start") > 1 else len(rows)
    return [r["step"] for r in rows[:end] if r.get("event") == "checkpoint"]


def test_torchx_job_saves_before_its_time_limit_requeues_itself_and_resumes(tmp_path):
    # a 2-minute job that stops 95 s before its limit; --max_retries 0, so TorchX's script requeues nothing
    job = torchx_slurm(tmp_path, "train.epochs=2000", environ=slow_steps(0.05))
    try:
        deadline = time.time() + 300
        while time.time() < deadline and len(starts(tmp_path)) < 2:
            time.sleep(1)
        first, *again = starts(tmp_path)
        assert first == 0 and again, "\n".join(f.read_text()[-2000:] for f in (tmp_path / "job").glob("*.out"))
        assert int(job_field(job, "Restarts")) >= 1
        saved = saved_before_first_resume(tmp_path)
        assert again[0] == saved[-1] > 0  # the requeued job resumed from the save made before the time limit
    finally:
        subprocess.run(["scancel", job])


def test_torchx_job_whose_time_limit_comes_before_the_first_step_is_requeued_without_a_traceback(tmp_path):
    # the margin leaves the job 3 s after it starts: the stop lands while torchrun starts, or its
    # workers import torch; either way nothing is lost, the job is requeued, and each says so in a line
    job = torchx_slurm(tmp_path, "train.epochs=2000", margin_s=117)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and int(job_field(job, "Restarts") or 0) < 1:
            time.sleep(1)
        time.sleep(3)  # duration: the requeued job's first lines
        err = "".join(f.read_text() for f in sorted((tmp_path / "job").glob("*.err")))
        assert int(job_field(job, "Restarts")) >= 1, err[-3000:]
        assert "stopped by the job's time limit" in err and "exit 75" in err, err[-3000:]
        assert "Traceback" not in err and "Logging error" not in err, err[-3000:]
    finally:
        subprocess.run(["scancel", job])


def test_torchx_job_with_bad_input_is_not_requeued_even_with_retries_left(tmp_path):
    job = torchx_slurm(tmp_path, "train.epochs=-1", max_retries=3)
    deadline = time.time() + 180
    while time.time() < deadline and job_field(job, "JobState") not in ("COMPLETED", "FAILED", "CANCELLED"):
        time.sleep(1)
    time.sleep(2)  # duration: of a look for a requeue, which would show by now
    err = (tmp_path / "job" / f"slurm-{job}-trainer-0.err").read_text()
    assert (
        job_field(job, "JobState") == "FAILED"
        and job_field(job, "Restarts") == "0"
        and job_field(job, "Requeue") == "0"
    ), err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "train.epochs" in errors[0], err
    assert "is no longer requeueable" in err and "Traceback" not in err
    assert not list((tmp_path / "ck").rglob("step-*"))


@pytest.mark.parametrize("confined", [True, False])
def test_a_step_with_fewer_cpus_than_the_job_asked_says_how_to_fix_it(confined):
    import sys

    # srun -c 2, then confined to one CPU as srun without -c confines a task where Slurm binds tasks
    taskset = ["taskset", "-c", "0"] if confined else []
    p = subprocess.run(
        [
            "srun",
            "-c",
            "2",
            *taskset,
            "env",
            "TRAINER_SLURM_MARGIN_S=soon",
            sys.executable,
            "-m",
            "trainer",
            "torchrun",
            "--nproc-per-node",
            "1",
            "-m",
            "trainer",
            "train",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in p.stderr.splitlines() if not line.startswith("srun: ")]
    assert p.returncode == 2, p.stdout + p.stderr
    warning = (
        "slurm: warning: this job step runs on 1 CPU(s) of the 2 per task the job holds (srun has not passed "
        "--cpus-per-task on since Slurm 22.05): export SRUN_CPUS_PER_TASK=2 before sbatch or torchx run, or srun -c 2"
    )
    assert lines[:-1] == ([warning] if confined else []), p.stderr
    assert lines[-1].startswith("error: TRAINER_SLURM_MARGIN_S='soon' is not a number of seconds"), p.stderr


def test_your_images_from_a_folder_to_a_model_on_slurm(tmp_path):
    """The README's two commands ("Your own images"): shards written once, then the batch script
    trains from them on its data volume (DATA_DIR), streamed, with the data's classes."""
    from conftest import make_jpegs, run, trainer_cmd

    make_jpegs(tmp_path / "myset", train=24, test=6, size=40)
    run(
        trainer_cmd(
            "data",
            "--shards",
            str(tmp_path / "myset-shards"),
            "data.name=imagefolder",
            f"data.dir={tmp_path / 'myset'}",
        ),
        cwd=ROOT,
    )
    job = sbatch(
        "slurm/ddp.sh",
        tmp_path,
        "data.name=shards",
        "data.loader=stream",
        "data.image_size=32",
        "train.epochs=1",
        "train.batch_size=24",
        extra_env={"DATA_DIR": str(tmp_path / "myset-shards")},
    )
    out = log(tmp_path, job)
    assert job_field(job, "ExitCode") == "0:0" and "done: step 10" in out, out
    assert (
        f"shards {tmp_path / 'myset-shards'}: 240 train / 60 test images, 10 classes, 32 px" in out
        and "streamed from shards" in out
    )


def test_an_etcd_rendezvous_endpoint_takes_the_place_of_the_first_nodes(tmp_path, etcd_server):
    """RDZV_ENDPOINT=HOST:PORT (an etcd server, v2 API): the job's rendezvous is torchrun's
    etcd-v2 one there, its state under the job id, and the job trains as with c10d."""
    import etcd

    port = etcd_server
    job = sbatch("slurm/ddp.sh", tmp_path, "train.epochs=1", extra_env={"RDZV_ENDPOINT": f"127.0.0.1:{port}"})
    out = log(tmp_path, job)
    assert job_field(job, "ExitCode") == "0:0" and "done: step" in out, out
    assert f"rendezvous at 127.0.0.1:{port}," in out, out
    assert etcd.Client(port=port).read(f"/torch/elastic/rendezvous/{job}", recursive=True).key, (
        "no rendezvous state in etcd"
    )


def test_the_batch_script_finds_pretrained_weights_in_the_shared_folder(tmp_path):
    """slurm/steps.sh sets TORCH_HOME=$SHARED_DIR/torch: a torchvision weights file put there by hand
    (the nodes have no network) starts the run; the check before torchrun found it too."""
    from test_pretrained import NO_NETWORK, hub_with_resnet18

    hub_with_resnet18(tmp_path / "torch")
    job = sbatch(
        "slurm/single.sh",
        tmp_path,
        "train.strategy=cpu",
        "model.name=torchvision.resnet18",
        "model.weights=IMAGENET1K_V1",
        "train.max_steps=2",
        "data.synthetic_train_size=256",
        "data.synthetic_test_size=64",
        extra_env=NO_NETWORK,
    )
    out = log(tmp_path, job)
    assert (
        job_field(job, "ExitCode") == "0:0"
        and "weights ResNet18_Weights.IMAGENET1K_V1" in out
        and "done: step 2" in out
    ), out
