"""The hang watchdog (trainer/worker/watchdog.py) and the supervisor's part in it (trainer/launch/supervisor.py):
a run that stops making progress ends as a crash with its stacks saved, and is restarted; with
real processes, real signals and real torchrun."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, TINY, env, spawn, trainer_cmd, worker

from trainer.contract import EXIT_HUNG
from trainer.launch.liveness import HEARTBEAT_MARGIN_S, kill_hung_workers
from trainer.worker import watchdog
from trainer.worker.watchdog import Watchdog


def test_the_bound_grows_with_the_slowest_pause_and_nothing_fires_before_the_first_beat(tmp_path):
    dog = Watchdog(3, tmp_path, 0)
    assert dog.bound() == 3 and dog._thread is None  # not armed: compilation is not watched
    a = time.monotonic()
    dog.beat(1)
    b = time.monotonic()
    time.sleep(0.05)  # duration: of the pause between the beats
    c = time.monotonic()
    dog.beat(2)
    d = time.monotonic()
    assert c - b <= dog.slowest <= d - a  # the pause between the beats, however loaded the machine
    assert dog.bound() == pytest.approx(max(3, 10 * dog.slowest))  # never less than the setting
    dog.slowest = 0.7
    assert dog.bound() == pytest.approx(7.0)
    dog.close()
    assert dog._thread is None and not list(tmp_path.iterdir())


def test_a_recovered_stall_raises_no_bound_and_is_left_out_of_the_pace(tmp_path):
    """A 120 s link cut ridden out is a stall, not the run's pace: the bound stays the setting (it
    became 10 x 121 s before), and the progress lines leave its time out."""
    dog = Watchdog(180, tmp_path, 0, timeout_s=300)
    for _step in range(1, 11):
        dog._pause(0.1, "step")
        dog._last_kind = "step"
    dog._pause(121.0, "step")
    assert dog.slowest == pytest.approx(0.1) and dog.bound() == 180
    assert dog.stalled_s == pytest.approx(120.9)
    dog._pause(0.1, "step")
    assert dog.stalled_s == pytest.approx(120.9)  # an ordinary step adds nothing


def test_a_stall_that_falls_in_a_save_counts_as_a_stall_but_a_slow_save_by_nature_does_not(tmp_path):
    """Saves are compared with saves: a save that always takes 3 s among 0.1 s steps is the run's
    nature (it raises the bound, is no stall); one blocked 60 s by a cut link is a stall."""
    dog = Watchdog(10, tmp_path, 0, timeout_s=300, world_size=2)
    for step in range(1, 41):
        dog._pause(0.1, "step")
        if step % 8 == 0:
            dog._pause(3.0, "save")
            dog._last_kind = "save"
        else:
            dog._last_kind = "step"
    assert dog.stalled_s == 0 and dog.bound() == pytest.approx(30)
    dog._pause(63.0, "save")
    assert dog.stalled_s == pytest.approx(60) and dog.bound() == pytest.approx(30)
    dog._last_kind = "save"
    dog._pause(0.1, "step")  # the step after the save: ordinary
    assert dog.stalled_s == pytest.approx(60)
    dog._last_kind = "eval"
    dog._pause(5.0, "step")  # the first step of an epoch, after evaluation: its start, not a stall
    assert dog.stalled_s == pytest.approx(60)


def test_slow_steps_raise_the_bound_but_never_past_the_collective_timeout(tmp_path):
    dog = Watchdog(30, tmp_path, 0, timeout_s=300, world_size=2)
    for _ in range(5):
        dog._pause(8.0, "step")  # slow by nature: every step
    assert dog.stalled_s == 0 and dog.bound() == pytest.approx(80)
    for _ in range(5):
        dog._pause(40.0, "step")
    assert dog.bound() == pytest.approx(0.9 * 300)  # 10 x 40 s would pass dist.timeout_s
    alone = Watchdog(30, tmp_path, 0, timeout_s=300)  # one process: no collective, no ceiling
    for _ in range(5):
        alone._pause(40.0, "step")
    assert alone.bound() == pytest.approx(400)
    # the setting itself is held below it
    assert Watchdog(180, tmp_path, 0, timeout_s=30, world_size=2).bound() == pytest.approx(27)


STALL_THEN_BLOCK = """
import sys, time
from pathlib import Path
from trainer.worker.watchdog import Watchdog
dog = Watchdog(3, Path(sys.argv[1]), 0, timeout_s=60)
for step in range(1, 21):
    time.sleep(0.02)
    dog.beat(step)
time.sleep(2.5)  # a stall the run recovers from (a cut link, a slow read), under the bound
dog.beat(21)
print("stalled", round(dog.stalled_s, 1), "bound", round(dog.bound(), 1), flush=True)
t = time.monotonic()
dog.at("data")
time.sleep(600)  # then a read that blocks for good
"""


def test_after_a_recovered_stall_a_hang_is_still_caught_within_the_setting(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", STALL_THEN_BLOCK, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        cwd=ROOT,
    )
    first = p.stdout.readline()
    t_block = time.monotonic()
    code = p.wait(timeout=60)
    caught = time.monotonic() - t_block
    assert code == EXIT_HUNG and first.split()[:2] == ["stalled", first.split()[1]] and float(first.split()[1]) >= 2, (
        first,
        p.stderr.read(),
    )
    assert "bound 3.0" in first  # the stall raised nothing (10 x 2.5 s = 25 s before)
    # the setting, a tick, and a loaded machine's slack: far below the 25 s a stall-raised bound gave
    assert caught < 3 + 10
    line = [x for x in p.stderr.read().splitlines() if x.startswith("rank 0")]
    assert line and "blocked in its own data read" in line[0], line


def test_off_with_zero(tmp_path):
    dog = Watchdog(0, tmp_path, 0)
    dog.beat(1)
    assert dog._thread is None
    dog.close()


def test_the_heartbeat_file_says_who_and_goes_with_close(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_EXIT_DIR", str(tmp_path))
    dog = Watchdog(30, tmp_path / "run", 3)
    dog.beat(7)
    info = json.loads((tmp_path / "hb-3").read_text())
    assert info == {
        "pid": os.getpid(),
        "rank": 3,
        "step": 7,
        "bound_s": 30.0,
        "hang_file": str(tmp_path / "run" / "hang-rank3.txt"),
    }
    dog.close()
    assert not (tmp_path / "hb-3").exists()


BLOCKED = """
import sys, time
from pathlib import Path
from trainer.worker.watchdog import Watchdog
def read_that_blocks():
    time.sleep(600)
dog = Watchdog(2, Path(sys.argv[1]), 5)
dog.beat(41)
read_that_blocks()
"""


def test_a_blocked_worker_writes_its_stacks_and_exits_124(tmp_path):
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-c", BLOCKED, str(tmp_path)], capture_output=True, text=True, timeout=60, env=env(), cwd=ROOT
    )
    assert p.returncode == EXIT_HUNG, p.stderr
    assert time.time() - t0 < 2 + 10  # the bound, a tick, and the interpreter's start
    stacks = (tmp_path / "hang-rank5.txt").read_text()
    assert (
        "rank 5" in stacks
        and "after step 41" in stacks
        and "read_that_blocks" in stacks
        and 'File "<string>"' in stacks
    )
    line = [x for x in p.stderr.splitlines() if x.startswith("rank 5 (")]
    assert line and "dist.hang_timeout_s" in line[0] and str(tmp_path / "hang-rank5.txt") in line[0], p.stderr


def stopped_process() -> subprocess.Popen:
    p = subprocess.Popen(["sleep", "300"])
    os.kill(p.pid, signal.SIGSTOP)
    # the signal is delivered asynchronously: on a busy machine the state reads R for a while
    deadline = time.time() + 10
    while time.time() < deadline and psutil.Process(p.pid).status() != psutil.STATUS_STOPPED:
        time.sleep(0.01)
    return p


def heartbeat(folder: Path, pid: int, rank: int, age_s: float, bound_s: float = 5) -> Path:
    hb = folder / f"hb-{rank}"
    hb.write_text(
        json.dumps(
            {
                "pid": pid,
                "rank": rank,
                "step": 12,
                "bound_s": bound_s,
                "hang_file": str(folder / f"hang-rank{rank}.txt"),
            }
        )
    )
    os.utime(hb, (time.time() - age_s, time.time() - age_s))
    return hb


def test_the_supervisor_kills_a_stopped_worker_past_its_bound_and_no_other(tmp_path):
    stale, fresh = stopped_process(), stopped_process()
    try:
        heartbeat(tmp_path, stale.pid, 0, age_s=16)  # 5 s bound + 10 s margin passed
        heartbeat(tmp_path, fresh.pid, 1, age_s=14)
        heartbeat(tmp_path, 999_999_999, 2, age_s=100)  # its attempt is over: nothing to kill
        said = kill_hung_workers(tmp_path)
        assert len(said) == 1 and "rank 0" in said[0] and ", stopped) has made no progress" in said[0]
        assert stale.wait(5) == -signal.SIGKILL
        assert fresh.poll() is None
        assert "no Python stacks" in (tmp_path / "hang-rank0.txt").read_text()
        assert not (tmp_path / "hb-0").exists() and not (tmp_path / "hb-2").exists() and (tmp_path / "hb-1").exists()
        assert kill_hung_workers(tmp_path) == []  # once
    finally:
        for p in (stale, fresh):
            p.kill()
            p.wait()


def test_a_stopped_python_worker_gets_its_stacks_read_from_outside(tmp_path):
    """A worker too frozen to write its own stacks (SIGSTOP): the supervisor reads them with py-spy
    before it kills the process, so the hang file says where it stood."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\ndef read_that_blocks():\n    time.sleep(300)\nprint('up', flush=True)\nread_that_blocks()",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "up"
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.time() + 10
        while time.time() < deadline and psutil.Process(p.pid).status() != psutil.STATUS_STOPPED:
            time.sleep(0.01)
        heartbeat(tmp_path, p.pid, 0, age_s=16)
        assert len(kill_hung_workers(tmp_path)) == 1 and p.wait(10) == -signal.SIGKILL
        text = (tmp_path / "hang-rank0.txt").read_text()
        assert "Python stacks read by py-spy" in text and "read_that_blocks" in text, text
    finally:
        p.kill()
        p.wait()


def test_the_supervisor_margin_lets_the_worker_go_first():
    assert watchdog.TICK_S * 5 < HEARTBEAT_MARGIN_S  # faulthandler's backstop fires within the margin too


# ------------------------------------------------------------------------------------------------
# The whole path: trainer launch (supervisor, torchrun, workers), a hang, a restart, the end

JOB = [*TINY, "train.epochs=24", "train.log_every=4", "dist.hang_timeout_s=5"]


def launch(ckpt: Path, nproc: int, extra_env: dict | None = None) -> subprocess.Popen:
    cmd = trainer_cmd("launch", "--nproc-per-node", str(nproc), *JOB, f"checkpoint.dir={ckpt}")
    return spawn(cmd, env(**(extra_env or {})), new_session=True)


def follow(agent: subprocess.Popen, on_line=None, timeout: float = 240) -> tuple[str, dict]:
    """The job's output to its end, and when (time.time()) the first line matching each key of
    ``on_line``'s return values was seen."""
    lines, deadline = [], time.time() + timeout
    try:
        for line in agent.stdout:
            lines.append(line)
            if on_line:
                on_line(line)
            if time.time() > deadline:
                break
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(30)
    return "".join(lines)


@pytest.mark.slow
def test_the_only_worker_stopped_with_sigstop_is_restarted_within_its_bound_plus_30_s(ckpt):
    agent, marks = launch(ckpt, 1), {}

    def on_line(line):
        if "epoch 3/24 step 4/" in line and "stop" not in marks:
            worker(agent, 0).send_signal(signal.SIGSTOP)
            marks["stop"] = time.time()
        if "resuming from" in line and "stop" in marks and "resumed" not in marks:
            marks["resumed"] = time.time()

    out = follow(agent, on_line)
    assert agent.returncode == 0 and "done: step 384" in out, out[-3000:]
    assert ", stopped) has made no progress" in out and "resumed" in marks, out[-3000:]
    recovery = marks["resumed"] - marks["stop"]
    print(f"SIGSTOP of the only worker -> resumed in {recovery:.1f} s (bound 5 s)")
    assert recovery < 5 + 30
    stacks = (ckpt / "hang-rank0.txt").read_text()  # read from outside: the stopped worker could not write them
    assert "Python stacks read by py-spy" in stacks and "train_epoch" in stacks, stacks[-2000:]


@pytest.mark.slow
def test_a_data_read_that_blocks_on_one_rank_leaves_every_ranks_stacks_and_the_job_finishes(ckpt):
    out = follow(launch(ckpt, 2, {"TRAINER_FAULT": "batch@40:sleep=600", "TRAINER_FAULT_RANK": "1"}))
    assert "done: step 384" in out, out[-3000:]
    assert re.search(r"rank 1 \([^)]+\): no training progress for \d+ s after step 39", out), out[-3000:]
    blocked = (ckpt / "hang-rank1.txt").read_text()
    assert "crash_point" in blocked and "train_epoch" in blocked  # the read that blocked, in the loop
    waiting = (ckpt / "hang-rank0.txt").read_text()  # rank 0 waited for it in a collective, and says where
    assert "train_epoch" in waiting and "after step 39" in waiting
    assert "resuming from" in out


@pytest.mark.slow
def test_a_checkpoint_write_that_blocks_is_caught_and_the_job_finishes(ckpt):
    out = follow(launch(ckpt, 1, {"TRAINER_FAULT": "before-rename@64:sleep=600"}))
    assert "done: step 384" in out and "resuming from" in out, out[-3000:]
    stacks = (ckpt / "hang-rank0.txt").read_text()
    assert "after step 64" in stacks and "crash_point" in stacks and "save" in stacks
    assert not (ckpt / "step-64").exists() or (ckpt / "step-64" / "meta.json").is_file()


# ------------------------------------------------------------------------------------------------
# Whom a rank waited for: every rank's record in a real store (torch's TCPStore on loopback)


@pytest.fixture
def store(monkeypatch):
    import torch.distributed as dist
    from conftest import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(watchdog, "PUBLISH_S", 0.1)
    monkeypatch.setattr(watchdog, "TICK_S", 0.1)
    yield server


def observe_for(peers: watchdog.Peers, seconds: float, others=()) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for other, phase in others:
            other.publish(12, phase)
        peers.observe()
        time.sleep(0.05)


def test_a_rank_whose_record_stops_is_named_with_its_host(store):
    waiting, stopped = watchdog.Peers(0, 2), watchdog.Peers(1, 2)
    stopped.host = "node2"
    stopped.publish(12, "step")  # then nothing: SIGSTOP, a frozen container, a lost host
    waiting.publish(13, "step")
    observe_for(waiting, 0.6)
    clause = waiting.culprit(13)
    assert "waiting for rank 1 (node2)" in clause and "has not run" in clause, clause


def test_a_stopped_rank_is_said_silent_for_as_long_as_it_has_not_run_not_as_long_as_it_was_watched(store):
    """The others look only once their own progress is overdue: a rank stopped 30 s before is not
    said to be silent for the few seconds since they began to look."""
    waiting, stopped = watchdog.Peers(0, 2), watchdog.Peers(1, 2)
    stopped.host = "node2"
    real = time.time
    watchdog.time.time = lambda: real() - 30  # its record written 30 s ago
    try:
        stopped.publish(12, "step")
    finally:
        watchdog.time.time = real
    observe_for(waiting, 0.6)
    silent = re.search(r"has not run for (\d+) s", waiting.culprit(13))
    assert silent and 30 <= int(silent.group(1)) <= 32, waiting.culprit(13)


def test_a_rank_blocked_in_its_data_read_is_named(store):
    waiting, reading = watchdog.Peers(0, 2), watchdog.Peers(1, 2)
    reading.host = "node2"
    # alive (its watchdog thread writes), its main thread in a read
    observe_for(waiting, 0.6, others=[(reading, "data")])
    clause = waiting.culprit(13)
    assert "rank 1 (node2), blocked in its data read at step 12" in clause, clause
    observe_for(waiting, 0.3, others=[(reading, "step")])
    assert "every rank is alive" in waiting.culprit(12)


def test_ranks_of_one_group_see_each_other_whatever_their_agents_restart_counts(store, monkeypatch):
    """A node that joined an elastic group later counts torchrun's restarts from 0 while the others
    count on: keyed by that count, a live rank read as one that never reported."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    waiting = watchdog.Peers(0, 2, group="g1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    joined = watchdog.Peers(1, 2, group="g1")
    joined.host = "node2"
    observe_for(waiting, 0.6, others=[(joined, "step")])
    assert "every rank is alive" in waiting.culprit(12), waiting.culprit(12)
    earlier = watchdog.Peers(1, 2, group="g0")  # the group before, in the same store: not this group's
    earlier.note_failure()
    assert "never reported" not in waiting.culprit(12)


def test_a_store_whose_first_read_has_not_come_back_names_no_rank(store, monkeypatch):
    """The store's host cut off: the read blocks. Until it has answered once, nothing is known of
    any rank, and no live rank may be named as the one waited for."""
    peers = watchdog.Peers(1, 3)
    peers._since = time.monotonic() - 40  # began to look 40 s ago; the read still blocks
    clause = peers.culprit(5)
    assert "has not answered for 40 s" in clause and "rank(s)" not in clause, clause


def test_a_store_that_does_not_answer_names_rank_0s_host(monkeypatch):
    from conftest import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens: rank 0's process is stopped or its host gone
    monkeypatch.setattr(watchdog, "STORE_TIMEOUT_S", 1.0)
    peers = watchdog.Peers(1, 2)
    peers.observe()
    assert "does not answer" in peers.culprit(5) and "rank 0" in peers.culprit(5)


def test_a_gpu_steps_waits_on_its_queue_are_its_pace_not_stalls(tmp_path):
    """Steps launched ahead: 1 ms pauses, then the queue is full and one waits 50 ms. Counted as
    stalls, the progress lines left the waits out (30,000 images/s shown for 5,500)."""
    dog = Watchdog(180, tmp_path, 0, timeout_s=300)
    for step in range(1, 101):
        dog._pause(0.05 if step % 5 == 0 else 0.001, "step")
        dog._last_kind = "step"
    assert dog.stalled_s == 0
    dog._pause(30.0, "step")  # a cut link ridden out still is one
    assert dog.stalled_s == pytest.approx(30.0 - 0.001)


def test_nccl_flight_records_go_to_the_run_folder_and_a_line_names_only_this_process_s(tmp_path, monkeypatch):
    """NCCL dumps its flight recorder where runtime.flight_recorder points it (unless the user
    chose a place), waiting 1 s for it; a line names the record only if this process wrote it
    (one left by an earlier attempt is not this fault's)."""
    from trainer.worker.runtime import flight_recorder

    for name in (
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/elsewhere/trace-")
    flight_recorder(tmp_path / "run")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "nccl-trace-rank")
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/elsewhere/trace-"
    assert (os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"], os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]) == (
        "1",
        "1000",
    )
    record = tmp_path / "run" / "nccl-trace-rank3"
    assert watchdog.flight_record(tmp_path / "run", 3, dump=True) == ""  # no NCCL group here: nothing to dump
    record.write_bytes(b"x")
    os.utime(record, (watchdog._STARTED - 60, watchdog._STARTED - 60))
    assert watchdog.flight_record(tmp_path / "run", 3) == ""
    record.write_bytes(b"x")
    assert watchdog.flight_record(tmp_path / "run", 3) == f"; NCCL flight record in {record}"
