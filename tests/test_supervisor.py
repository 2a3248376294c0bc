"""The exit status contract at the launcher (trainer/launch/supervisor.py) and one writer per run folder
(checkpoint.FolderLock), with real torchrun, real signals and real processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import ROOT, TINY, env, newest, run, spawn, trainer_cmd

from trainer.contract import EXIT_PREEMPTED, EXIT_RUNNING, EXIT_USAGE
from trainer.launch import liveness, supervisor
from trainer.launch.procs import has_children
from trainer.launch.supervisor import recorded, verdict
from trainer.worker.checkpoint import folder as checkpoint
from trainer.worker.checkpoint import lock as checkpoint_lock
from trainer.worker.checkpoint import store
from trainer.worker.checkpoint.folder import CheckpointError
from trainer.worker.checkpoint.lock import FolderLock

LONG = [*TINY, "train.epochs=400", "train.log_every=8", "checkpoint.every_steps=0"]


@pytest.mark.parametrize(
    "torchrun_code, workers, expected",
    [
        (0, [], 0),  # finished
        (0, [75, 0], 0),  # an earlier attempt was stopped, the last finished
        (1, [75, 75], EXIT_PREEMPTED),  # torchrun signalled; every worker saved and left with 75
        (143, [75], EXIT_PREEMPTED),
        (1, [2, 2], EXIT_USAGE),  # bad input found by the workers
        (1, [75, 1], 1),  # one worker did not get out cleanly: a crash
        (1, [], 1),  # workers killed: a crash
        (-9, [], 137),  # torchrun killed
        (75, [], 1),  # torchrun's own 75 or 2 is never taken for the contract's
        (2, [], 1),
    ],
)
def test_verdict(torchrun_code, workers, expected):
    assert verdict(torchrun_code, workers) == expected


@pytest.mark.parametrize(
    "torchrun_code, workers, expected",
    [
        (143, [], EXIT_PREEMPTED),  # stopped at its rendezvous, before any worker: nothing lost
        (-15, [], EXIT_PREEMPTED),
        (1, [], 1),  # not a stop: a crash still
        (143, [75, 1], 143),  # a worker crashed: a crash still
    ],
)
def test_verdict_of_a_stop_passed_on(torchrun_code, workers, expected):
    assert verdict(torchrun_code, workers, signalled=True) == expected


def test_the_exitcode_policy_moves_75_and_crashes_into_the_retried_range_until_a_node_makes_no_progress(
    tmp_path, monkeypatch
):
    """TRAINER_EXIT_POLICY=exitcode, for a launcher that retries only 128-255 (Kubeflow's ExitCode):
    0 and 2 stay, 75 and crashes move up by 128, a signal's code stays; the third crash in a row
    of one node with no newer checkpoint is final (1). A newer checkpoint starts the count again."""
    ckpt = tmp_path / "ckpt"
    args = ckpt  # the run folder, as the supervisor parsed it from the workers' command
    monkeypatch.setenv("HOSTNAME", "job-worker-0")
    assert [supervisor.for_launcher(c, args, "") for c in (0, 2, 75, 1, 137)] == [
        0,
        2,
        75,
        1,
        137,
    ]  # no policy: the contract's own
    assert [supervisor.for_launcher(c, args, "exitcode") for c in (0, 2, 75, 137)] == [0, 2, 203, 137]
    assert [supervisor.for_launcher(c, args, "exitcode") for c in (124, 1)] == [
        252,
        129,
    ]  # two crashes, no checkpoint yet
    (ckpt / "step-16").mkdir(parents=True)
    (ckpt / "step-16" / checkpoint.META).write_text("{}")  # a newer checkpoint: progress
    assert [supervisor.for_launcher(1, args, "exitcode") for _ in range(3)] == [129, 129, 1]
    assert json.loads((ckpt / ".crashes" / "job-worker-0.json").read_text())["step"] == "step-16"
    monkeypatch.setenv("HOSTNAME", "job-worker-1")  # every node counts its own
    assert supervisor.for_launcher(1, args, "exitcode") == 129


def test_an_unknown_exit_policy_is_bad_input_in_one_line(tmp_path):
    p = run(
        trainer_cmd("torchrun", "--nproc-per-node=1", "-m", "trainer", "train", *TINY, f"checkpoint.dir={tmp_path}"),
        env=env(TRAINER_EXIT_POLICY="kubeflow"),
        check=False,
        timeout=60,
    )
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and lines == [
        "TRAINER_EXIT_POLICY='kubeflow' is not a policy; set it to exitcode (Kubeflow's restartPolicy: ExitCode) or "
        "leave it unset"
    ], p.stderr


def launch(ckpt: Path, *overrides: str, nproc: int = 2, extra_env: dict | None = None) -> subprocess.Popen:
    """`trainer launch` in its own session (as a terminal job), output in a pipe."""
    cmd = trainer_cmd("launch", "--nproc-per-node", str(nproc), *LONG, f"checkpoint.dir={ckpt}", *overrides)
    return spawn(cmd, env(**(extra_env or {})), new_session=True)


def until(agent: subprocess.Popen, words: str, timeout: float = 120) -> list[str]:
    lines, deadline = [], time.time() + timeout
    for line in agent.stdout:
        lines.append(line)
        if words in line or time.time() > deadline:
            break
    return lines


def trainers_on(ckpt: Path) -> list[psutil.Process]:
    """Live processes training into ``ckpt`` (orphans included)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if (
                f"checkpoint.dir={ckpt}" in " ".join(p.info["cmdline"] or [])
                and p.info["status"] != psutil.STATUS_ZOMBIE
            ):
                out.append(p)
        except psutil.Error:
            continue
    return out


def gone(ckpt: Path, timeout: float = 20) -> bool:
    deadline = time.time() + timeout
    while trainers_on(ckpt) and time.time() < deadline:
        time.sleep(0.2)
    return not trainers_on(ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C to the job"])
def test_a_stop_signal_gives_75_with_a_checkpoint_of_that_step_and_a_relaunch_resumes(ckpt, how):
    agent = launch(ckpt)
    until(agent, "epoch 2/")
    if how == "Ctrl-C to the job":
        os.killpg(agent.pid, signal.SIGINT)  # a terminal sends it to the whole foreground job
    else:
        agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=120)[0]
    assert agent.returncode == EXIT_PREEMPTED, out[-3000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    sig = "SIGINT" if "Ctrl-C" in how else "SIGTERM"
    assert f"{sig} received: the workers stop after their current step" in out  # the launcher, at once
    assert "stopping after the current step and saving" not in out  # one line, the launcher's: not again from rank 0
    stopped = [line for line in out.splitlines() if line.startswith(f"stopped by {sig} at step")]
    assert stopped, out[-3000:]
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert newest(ckpt).name == f"step-{step}"
    assert gone(ckpt)
    again = run(
        trainer_cmd("launch", "--nproc-per-node", "2", *TINY, f"checkpoint.dir={ckpt}", "train.epochs=4"), check=False
    )
    assert again.returncode == 0 and f"resuming from {ckpt}/step-{step}" in again.stdout, (
        again.stdout[-2000:] + again.stderr[-2000:]
    )


def catch_sigterm(ckpt: Path) -> list[psutil.Process]:
    """The workers training into ``ckpt`` that have a SIGTERM handler of their own (/proc's SigCgt)."""
    found = []
    for p in trainers_on(ckpt):
        try:
            cmd = " ".join(p.cmdline())
            caught = int(
                next(
                    x for x in Path(f"/proc/{p.pid}/status").read_text().splitlines() if x.startswith("SigCgt:")
                ).split()[1],
                16,
            )
        except (psutil.Error, OSError, StopIteration):
            continue
        if (
            " train " in f"{cmd} "
            and "trainer.launch.torchrun" not in cmd
            and " launch " not in cmd
            and caught >> (signal.SIGTERM - 1) & 1
        ):
            found.append(p)
    return found


@pytest.mark.slow
def test_a_stop_while_the_workers_start_gives_75_at_once_and_the_relaunch_trains(ckpt):
    # Slurm's time limit or an eviction can come while the workers still import torch: that is a
    # stop (75: Slurm requeues, nothing was trained to lose), not a crash (143 from the default action)
    agent = launch(ckpt)
    deadline = time.time() + 60
    while len(catch_sigterm(ckpt)) < 2 and time.time() < deadline:  # handler up, torch's import (seconds) ahead
        time.sleep(0.02)
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=120)[0]
    assert agent.returncode == EXIT_PREEMPTED, out[-3000:]
    assert re.search(
        r"rank 0 \(\S+\) stopped by SIGTERM while starting, before its first step: nothing to save; exit 75", out
    ), out[-3000:]
    assert "Traceback" not in out and "epoch 1/" not in out, out[-3000:]
    assert not checkpoint.complete(ckpt) and gone(ckpt)
    again = run(
        trainer_cmd("launch", "--nproc-per-node", "2", *TINY, f"checkpoint.dir={ckpt}", "train.epochs=1"), check=False
    )
    assert again.returncode == 0 and "starting fresh" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]


def test_a_stop_while_torchrun_waits_at_its_rendezvous_gives_75_in_a_line(ckpt):
    """Slurm's time limit while the first node waits for the others (before torch installs its
    signal handlers): torchrun died of the signal without a word, 143, which the job's script took
    for a crash and did not requeue. Now: torchrun says it stopped, the supervisor 75."""
    from conftest import free_port

    agent = subprocess.Popen(
        trainer_cmd(
            "torchrun",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--rdzv-id=alone",
            "-m",
            "trainer",
            "train",
            *TINY,
            f"checkpoint.dir={ckpt}",
        ),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not any(
        "trainer.launch.torchrun" in " ".join(c.cmdline()) for c in psutil.Process(agent.pid).children()
    ):
        time.sleep(0.1)
    time.sleep(5)  # duration: torchrun is at its rendezvous, waiting for the second node
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=60)[0]
    assert agent.returncode == EXIT_PREEMPTED, out
    assert "torchrun: stopped on SIGTERM" in out and "Traceback" not in out and "Logging error" not in out, out
    assert (
        out.splitlines()[-1]
        == "stopped by SIGTERM before any worker started: nothing to save; exit 75 (run the same command to resume)"
    ), out


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once(ckpt):
    # the stop's save takes a minute here (a slow volume), so the second Ctrl-C lands inside it
    agent = launch(ckpt, "checkpoint.every_epochs=0", extra_env={"TRAINER_FAULT": "before-rename:sleep=60"})
    until(agent, "epoch 2/")
    os.killpg(agent.pid, signal.SIGINT)
    # the supervisor passes it on (the save's folder below shows they got it)
    until(agent, "SIGINT received: the workers stop")
    deadline = time.time() + 60
    while time.time() < deadline and not list(ckpt.glob(".tmp-step-*")):  # the stop's save has begun
        time.sleep(0.1)
    t0 = time.time()
    os.killpg(agent.pid, signal.SIGINT)
    out = agent.communicate(timeout=60)[0]
    assert agent.returncode not in (0, EXIT_USAGE, EXIT_PREEMPTED), out[-2000:]
    assert "second Ctrl-C" in out and gone(ckpt) and time.time() - t0 < 15
    assert not list(ckpt.glob("step-*")), "the interrupted save must not look complete"


@pytest.mark.slow
def test_bad_input_found_by_the_workers_exits_2_without_restarts(ckpt):
    """`trainer torchrun` (no pre-checks, as on Kubernetes and Slurm): a worker's usage error stops
    torchrun at once instead of being retried --max-restarts times as a crash."""
    t0 = time.time()
    p = run(
        trainer_cmd(
            "torchrun",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=3",
            "-m",
            "trainer",
            "train",
            *TINY,
            f"checkpoint.dir={ckpt}",
            "train.bath_size=8",
        ),
        check=False,
        timeout=120,
    )
    out = p.stdout + p.stderr
    assert p.returncode == EXIT_USAGE, out[-3000:]
    assert out.count("unknown config key 'train.bath_size'") == 1, out[-3000:]  # one attempt, rank 0 only
    assert "Traceback" not in out and time.time() - t0 < 60


@pytest.mark.slow
def test_killing_the_launcher_takes_its_workers_along_and_frees_the_folder(ckpt):
    agent = launch(ckpt)
    until(agent, "epoch 2/")
    assert len(trainers_on(ckpt)) >= 4  # launcher, torchrun, two workers
    os.killpg(agent.pid, signal.SIGKILL)  # the workers run in torchrun's session, not this group
    agent.wait(10)
    assert gone(ckpt), f"orphaned workers: {trainers_on(ckpt)}"
    again = run(trainer_cmd("train", *TINY, f"checkpoint.dir={ckpt}", "train.epochs=3"))
    assert "resuming from" in again.stdout


@pytest.mark.slow
def test_a_second_run_on_a_held_folder_exits_2_naming_the_holder(ckpt):
    agent = launch(ckpt)
    until(agent, "epoch 2/")
    before = (ckpt / "metrics.jsonl").read_text()
    for cmd in (
        trainer_cmd("launch", "--nproc-per-node", "2", *TINY, f"checkpoint.dir={ckpt}"),
        trainer_cmd("train", *TINY, f"checkpoint.dir={ckpt}"),
    ):
        p = run(cmd, check=False, timeout=60)
        assert p.returncode == EXIT_USAGE, p.stderr[-2000:]
        line = [x for x in p.stderr.splitlines() if x.startswith("error:")]
        assert (
            len(line) == 1
            and "is in use by another run" in line[0]
            and f"on {socket.gethostname()}" in line[0]
            and "since" in line[0]
        ), p.stderr
    agent.send_signal(signal.SIGTERM)
    agent.communicate(timeout=120)
    after = (ckpt / "metrics.jsonl").read_text()
    assert after.startswith(before)
    rows = [json.loads(x) for x in after.splitlines()]
    assert sum(r["event"] == "start" for r in rows) == 1, "the refused runs wrote into the run's log"


# ------------------------------------------------------------------------------------------------
# The lock itself

HOLD = """
import json, sys, time, fcntl, os
from pathlib import Path
path, host, age = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
run_id = sys.argv[4] if len(sys.argv) > 4 else None
path.parent.mkdir(parents=True, exist_ok=True)
fd = os.open(path, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
now = time.time()
held = {"host": host, "pid": os.getpid(), "since": now - age, "heartbeat": now - age, "run_id": run_id}
os.write(fd, json.dumps(held).encode())
print("held", flush=True)
time.sleep(120)
"""


def holder(root: Path, host: str, age: float, run_id: str = "") -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(root / checkpoint.LOCK), host, str(age), *([run_id] if run_id else [])],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_live_holder_blocks_and_a_dead_one_does_not(tmp_path):
    h = holder(tmp_path, socket.gethostname(), 0)
    try:
        with pytest.raises(
            CheckpointError,
            match=rf"in use by another run \(pid {h.pid} on {socket.gethostname()}, since .*; stop that run",
        ):
            FolderLock(tmp_path).acquire()
        with pytest.raises(CheckpointError, match="in use by another run"):
            FolderLock(tmp_path).check()
    finally:
        h.kill()
        h.wait()
    lock = FolderLock(tmp_path)  # the kernel dropped the dead holder's lock
    lock.acquire()
    info = json.loads((tmp_path / checkpoint.LOCK).read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    lock.release()


def test_a_dead_hosts_lock_is_broken_after_its_heartbeat_goes_stale(tmp_path):
    """A host that died holding the lock on a network file system: the server may keep the lock
    for a while; a stale heartbeat (over stale_s) lets the next run take over, with a warning."""
    fresh = holder(tmp_path, "other-host", 5)
    try:
        with pytest.raises(CheckpointError, match="on other-host"):
            FolderLock(tmp_path, stale_s=60).acquire()
    finally:
        fresh.kill()
        fresh.wait()
    (tmp_path / checkpoint.LOCK).unlink()
    stale = holder(tmp_path, "other-host", 600)
    try:
        said: list[str] = []
        lock = FolderLock(tmp_path, stale_s=60)
        lock.acquire(say=said.append)
        assert said and "broke the lock" in said[0] and "other-host" in said[0]
        assert json.loads((tmp_path / checkpoint.LOCK).read_text())["pid"] == os.getpid()
        assert list(tmp_path.glob(".lock.stale-*"))
        lock.release()
    finally:
        stale.kill()
        stale.wait()


def test_this_jobs_rank_0_lost_with_its_host_hands_the_lock_over_after_two_heartbeats(tmp_path, monkeypatch):
    """An elastic group re-formed without the host of rank 0 (the folder on a network file system,
    whose server keeps the dead host's lock): the new rank 0, of the same job, waits for that
    holder's heartbeat to go two beats stale, not the 120 s a stranger's lock gets, and takes over."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    other_job = holder(tmp_path, "lost-host", 3, run_id="job-6")
    try:
        with pytest.raises(CheckpointError, match="on lost-host"):
            FolderLock(tmp_path, heartbeat_s=1, stale_s=60).acquire(wait_s=0)  # another job's: no take-over
    finally:
        other_job.kill()
        other_job.wait()
    (tmp_path / checkpoint.LOCK).unlink()
    ours = holder(tmp_path, "lost-host", 1, run_id="job-7")
    try:
        said: list[str] = []
        t0 = time.monotonic()
        lock = FolderLock(tmp_path, heartbeat_s=1, stale_s=60)
        # a re-form keeps torchrun's restart count: no wait asked for, the same job waits
        lock.acquire(wait_s=0, say=said.append)
        assert time.monotonic() - t0 < 3 * 1 + 2 and said and "broke the lock" in said[0] and "lost-host" in said[0], (
            said
        )
        lock.release()
    finally:
        ours.kill()
        ours.wait()


def test_the_heartbeat_is_written_while_the_lock_is_held(tmp_path):
    lock = FolderLock(tmp_path, heartbeat_s=0.1)
    lock.acquire()
    first = json.loads((tmp_path / checkpoint.LOCK).read_text())["heartbeat"]
    seen, deadline = [], time.time() + 10  # every 0.1 s: a loaded machine may be slower, never this slow
    while time.time() < deadline and (not seen or seen[-1] == first):
        # never an empty file, however often read
        seen.append(json.loads((tmp_path / checkpoint.LOCK).read_text())["heartbeat"])
    assert seen[-1] > first and (tmp_path / checkpoint.LOCK).stat().st_size == checkpoint_lock.LOCK_RECORD_BYTES
    lock.release()


def test_set_aside_folders_are_pruned_beyond_a_small_bound(tmp_path):
    state = {"model": {"w": torch.ones(1)}, "train": {"step": 1}}
    for _ in range(5):  # two writers saving the same step over and over
        store.write_state(state, tmp_path, 1, 3)
        time.sleep(0.01)
    (tmp_path / "step-0.corrupt").mkdir()
    said: list[str] = []
    gone_ = checkpoint.prune_set_aside(tmp_path, say=said.append)
    left = sorted(p.name for p in tmp_path.iterdir() if checkpoint.SET_ASIDE.match(p.name))
    assert len(left) == checkpoint.KEEP_SET_ASIDE and "step-0.corrupt" in left  # the newest ones stay
    assert gone_ and said and "deleted" in said[0]
    assert (tmp_path / "step-1" / "meta.json").is_file()


@pytest.mark.slow
def test_make_run_local_shows_the_trainers_75(tmp_path):
    """GNU make exits 2 for any failed recipe (or dies of the Ctrl-C it got too), so the 75 shows
    in its message; `trainer launch` itself, which run-local runs, exits 75 (README)."""
    ck = tmp_path / "ck"
    p = subprocess.Popen(
        [
            "make",
            "run-local",
            "CONFIG=configs/smoke.yaml",
            f"ARGS=train.epochs=400 checkpoint.dir={ck}",
            f"PYTHON={sys.executable}",
            f"VENV={Path(sys.executable).parent.parent}",
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    until(p, "epoch 2/")
    launcher = next(c for c in psutil.Process(p.pid).children(recursive=True) if "launch" in " ".join(c.cmdline()))
    launcher.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert "run-local] Error 75" in out and p.returncode == 2, out[-2000:]
    assert newest(ck).name.startswith("step-")


def test_launch_refuses_a_volume_without_room_for_keep_plus_one_checkpoints(tmp_path):
    """Checked by rank 0 before it builds anything else (seednet: 4.8 GB a checkpoint with momentum):
    one line, exit 2, no torchrun restart, no checkpoint written."""
    import shutil

    per = 604_137_490 * 4 * 2
    keep = shutil.disk_usage(tmp_path).free // per + 1
    p = run(
        trainer_cmd(
            "launch",
            "--nproc-per-node",
            "2",
            "model.name=seednet",
            "data.name=synthetic",
            f"checkpoint.dir={tmp_path / 'ck'}",
            f"checkpoint.keep={keep}",
        ),
        check=False,
    )
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == EXIT_USAGE and len(errors) == 1, p.stderr
    assert f"checkpoint.keep={keep} needs (K + 1 checkpoints at a save, 4.83 GB each)" in errors[0]
    # the error is the last line: no torchrun restart, no shutdown log after it
    assert (
        p.stderr.splitlines()[-1] == errors[0]
        and "restart worker group" not in p.stderr
        and not list((tmp_path / "ck").glob("step-*"))
    )


def test_the_supervisor_gives_each_torchrun_attempt_a_fresh_rendezvous_store(tmp_path):
    """Set once, in the supervisor every launcher goes through (not in each manifest and script)."""
    seen = tmp_path / "seen"
    plain = {k: v for k, v in env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    run(
        trainer_cmd(
            "torchrun",
            "--standalone",
            "--nproc-per-node=1",
            "--no-python",
            "sh",
            "-c",
            f'echo "$TORCH_DISABLE_SHARE_RDZV_TCP_STORE" > {seen}',
        ),
        env=plain,
    )
    assert seen.read_text().strip() == "1"


def test_a_missing_home_is_replaced_by_a_private_writable_one(tmp_path, monkeypatch):
    from trainer.launch.node import writable_home

    monkeypatch.setenv("HOME", str(tmp_path / "not-there"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    writable_home()
    home = Path(os.environ["HOME"])
    assert home == tmp_path / f"trainer-home-{os.getuid()}" and home.is_dir()
    assert home.stat().st_mode & 0o777 == 0o700
    writable_home()  # a writable HOME is kept
    assert os.environ["HOME"] == str(home)


# An agent left blocked on a rendezvous store it cannot reach: a real process whose child has
# exited and was never reaped (what a torchrun agent stuck in a store read looks like from outside).
AGENT = """import os, time
if os.fork() == 0:
    os._exit(124)
time.sleep(60)
"""


@pytest.fixture
def agent():
    p = subprocess.Popen([sys.executable, "-c", AGENT])
    yield p
    p.kill()
    p.wait()


def test_an_agent_left_without_a_live_worker_past_its_rendezvous_bound_is_named(agent, monkeypatch):

    monkeypatch.setattr(liveness, "LOST_RENDEZVOUS_MARGIN_S", 1.5)
    p = agent
    watch = liveness.LostRendezvous(["--rdzv-endpoint=node0:29400", "--rdzv-conf=join_timeout=1,read_timeout=1"], p.pid)
    assert watch.bound_s == 2.5
    assert watch.check() == ""  # within the bound
    deadline = time.time() + 10
    while time.time() < deadline and [c.status() for c in psutil.Process(p.pid).children()] != [psutil.STATUS_ZOMBIE]:
        time.sleep(0.05)
    assert has_children(p.pid) is False  # its exited, unreaped child is no worker
    t_gone, line = time.time(), ""
    while time.time() < t_gone + 30 and not (line := watch.check()):
        time.sleep(0.1)
    assert re.search(r"no worker has run on this node for \d+ s", line) and "rendezvous at node0:29400" in line, line
    assert "(join_timeout 1 s)" in line and "exiting 1" in line


def test_an_agent_with_a_live_worker_is_left_alone(monkeypatch):

    monkeypatch.setattr(liveness, "LOST_RENDEZVOUS_MARGIN_S", 0.0)
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])",
        ]
    )
    try:
        deadline = time.time() + 10
        while time.time() < deadline and not psutil.Process(p.pid).children():
            time.sleep(0.05)
        watch = liveness.LostRendezvous(["--rdzv-conf=join_timeout=0"], p.pid)
        time.sleep(0.5)  # duration: past the (zero) bound, with a worker alive
        assert has_children(p.pid) is True and watch.check() == ""
        # torchrun's default
        assert liveness.LostRendezvous([], p.pid).bound_s == 600 + liveness.LOST_RENDEZVOUS_MARGIN_S
    finally:
        for c in psutil.Process(p.pid).children(recursive=True):
            c.kill()
        p.kill()
        p.wait()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--nnodes", "2", "--rdzv-backend=c10d", "-m", "trainer", "train"],
            ["--rdzv-conf=read_timeout=600", "--nnodes", "2", "--rdzv-backend=c10d", "-m", "trainer", "train"],
        ),
        (
            ["--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=30", "-m", "trainer", "train", "a=1"],
            ["--rdzv-conf=join_timeout=30,read_timeout=30", "--rdzv-backend", "c10d", "-m", "trainer", "train", "a=1"],
        ),
        (
            ["--rdzv_backend=c10d", "--rdzv_conf=read_timeout=5", "-m", "trainer"],
            ["--rdzv_backend=c10d", "--rdzv_conf=read_timeout=5", "-m", "trainer"],
        ),
        (["--standalone", "-m", "trainer"], ["--standalone", "-m", "trainer"]),
        (
            ["--nnodes=2:3", "--rdzv-backend=c10d", "-m", "trainer"],
            [
                "--rdzv-conf=read_timeout=600,last_call_timeout=5,keep_alive_interval=3",
                "--nnodes=2:3",
                "--rdzv-backend=c10d",
                "-m",
                "trainer",
            ],
        ),
        (
            [
                "--nnodes=2:3",
                "--rdzv-backend=c10d",
                "--rdzv-conf=last_call_timeout=20,read_timeout=9,keep_alive_interval=5",
                "-m",
                "trainer",
            ],
            [
                "--nnodes=2:3",
                "--rdzv-backend=c10d",
                "--rdzv-conf=last_call_timeout=20,read_timeout=9,keep_alive_interval=5",
                "-m",
                "trainer",
            ],
        ),
        (
            ["--nnodes=2:3", "--rdzv-backend=etcd-v2", "-m", "trainer"],
            [
                "--rdzv-conf=last_call_timeout=2,keep_alive_interval=3",
                "--nnodes=2:3",
                "--rdzv-backend=etcd-v2",
                "-m",
                "trainer",
            ],
        ),
        (
            ["--nnodes=2", "--rdzv-backend=etcd-v2", "-m", "trainer"],
            ["--nnodes=2", "--rdzv-backend=etcd-v2", "-m", "trainer"],
        ),
    ],
)
def test_store_reads_wait_as_long_as_the_rendezvous_and_elastic_groups_re_form_soon(argv, expected):
    """A store read that times out on a cut link leaves the agent's connection out of step
    (tests/test_hosts.py shows the job ending): reads wait as long as join_timeout, unless given.
    An elastic range re-forms 5 s after its MIN nodes are back, unless given."""
    from trainer.launch.torchrun_args import with_rdzv_defaults

    assert with_rdzv_defaults(argv) == expected


def test_workers_keep_node_caches_on_the_volume(tmp_path, monkeypatch):
    """What a fresh node lacks goes to the checkpoint volume, where a restart on any node finds it:
    the CUDA driver's JIT cache always, and the workers' Python bytecode where the installation has
    none (pip --no-compile, a site-packages the job cannot write, PYTHONDONTWRITEBYTECODE=1: every
    process compiles its sources at every start otherwise)."""
    from trainer.launch.node import node_cache_env
    from trainer.launch.torchrun_args import worker_config

    (tmp_path / "mod_without_bytecode.py").write_text("x = 1\n")  # never imported: no .pyc anywhere
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.delenv("CUDA_CACHE_PATH", raising=False)
    args = [
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "trainer",
        "train",
        "--config",
        "configs/smoke.yaml",
        f"checkpoint.dir={tmp_path / 'ck'}",
    ]
    prefix = (tmp_path / "ck" / "compile-cache" / "python-bytecode").resolve()
    jit = {"CUDA_CACHE_PATH": str((tmp_path / "ck" / "compile-cache" / "cuda-jit").resolve())}
    assert node_cache_env(worker_config(args), probe="mod_without_bytecode") == {
        **jit,
        "PYTHONPYCACHEPREFIX": str(prefix),
    }
    assert node_cache_env(worker_config(args)) == jit  # this venv's torch carries its bytecode: left alone
    assert node_cache_env(worker_config([*args, "model.compile_cache=false"]), probe="mod_without_bytecode") == {}
    assert node_cache_env(worker_config(["--standalone", "-m", "other.module"]), probe="mod_without_bytecode") == {}
    # a worker started with it writes its bytecode there (and reads it back on the next start)
    child = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONPYCACHEPREFIX": str(prefix)}
    child.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-c", "import mod_without_bytecode"], env=child, check=True)
    assert list(prefix.rglob("mod_without_bytecode*.pyc"))
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "mine"))  # the caller's own settings win
    monkeypatch.setenv("CUDA_CACHE_PATH", str(tmp_path / "nv"))
    assert node_cache_env(worker_config(args), probe="mod_without_bytecode") == {}


def test_an_elastic_range_that_does_not_split_the_batch_is_refused_before_torchrun(tmp_path):
    """Found at launch on every node, in one line with the fix, not when a node joins mid-run."""
    t0 = time.time()
    p = run(
        trainer_cmd(
            "torchrun",
            "--nnodes=2:3",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:1",
            "-m",
            "trainer",
            "train",
            "--config",
            "configs/smoke.yaml",
            "train.batch_size=64",
            f"checkpoint.dir={tmp_path / 'ck'}",
        ),
        check=False,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert (
        len(lines) == 1
        and lines[0].startswith("error: train.batch_size=64 does not split over 3 node(s)")
        and "train.batch_size=66" in lines[0]
    ), p.stderr
    assert not (tmp_path / "ck").exists() and time.time() - t0 < 30  # no torchrun, no rendezvous wait


def test_the_verdict_reads_the_newest_group_and_a_killed_group_is_no_preemption(tmp_path):
    """An elastic re-form keeps torchrun's restart count: each group's records are its own (the
    round's store port), the newest one decides, and a group killed before it recorded an exit
    (its start records left) is a crash, not the 75 of the group before it."""

    def write(name: str, code: int, age: float) -> None:
        (tmp_path / name).write_text(f"{code}\n")
        os.utime(tmp_path / name, (time.time() - age, time.time() - age))

    for rank in range(3):
        write(f"0.29500-{rank}", EXIT_PREEMPTED, 20)  # the group of three stopped for a re-form
    assert recorded(tmp_path) == [EXIT_PREEMPTED] * 3
    for rank in range(2):
        write(f"0.29611-{rank}", EXIT_RUNNING, 5)  # the group of two started, then was killed
    assert sorted(recorded(tmp_path)) == [EXIT_RUNNING] * 2
    assert verdict(1, recorded(tmp_path)) == 1


def test_the_time_left_of_a_heterogeneous_job_is_its_least_component():
    """squeue -o %L prints one line per component of a heterogeneous job (TorchX's multi-node
    Slurm jobs): the least of them, not None (which meant: never stop to save)."""
    from trainer.launch.slurm import parse_time_left

    assert parse_time_left("1-02:03:04\n") == 93784
    assert parse_time_left("4:59\n5:00\n") == 299
    assert parse_time_left("UNLIMITED\n") is None and parse_time_left("") is None
