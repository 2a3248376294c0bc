from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY, env, newest, run, saved, train, trainer_cmd, tree_files, weights

CONSTANT = ("optim.schedule=constant", "optim.momentum=0.9")


def test_two_epochs_equal_one_then_a_resumed_one_bit_for_bit(tmp_path):
    train(tmp_path / "straight", "train.epochs=2", *CONSTANT)
    train(tmp_path / "split", "train.epochs=1", *CONSTANT)
    p = train(tmp_path / "split", "train.epochs=2", *CONSTANT)
    assert "resuming from" in p.stdout and "step-16" in p.stdout
    a, b = weights(newest(tmp_path / "straight")), weights(newest(tmp_path / "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_resumed_airnet_ends_as_the_straight_run_without_recomputing_its_whitening(tmp_path):
    """A resume skips the whitening computed from data (its checkpoint holds the weights): the end
    is still bit for bit the uninterrupted run's."""
    airnet = ("model.name=airnet", "train.batch_size=64", *CONSTANT)
    train(tmp_path / "straight", "train.epochs=2", *airnet)
    train(tmp_path / "split", "train.epochs=1", *airnet)
    p = train(tmp_path / "split", "train.epochs=2", *airnet)
    assert "resuming from" in p.stdout and "step-8" in p.stdout
    a, b = weights(newest(tmp_path / "straight")), weights(newest(tmp_path / "split"))
    assert "whiten.weight" in a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_async_checkpoints_under_ddp_keep_the_ranks_in_step(ckpt):
    """Only rank 0 has a background writer; the ranks must still make the same collectives."""
    p = train(
        ckpt,
        "train.epochs=3",
        "checkpoint.async_save=true",
        "checkpoint.every_steps=5",
        "dist.timeout_s=60",
        nproc=2,
        timeout=240,
    )
    assert "done: step 48" in p.stdout
    assert {f"step-{s}" for s in (40, 45, 48)} <= {d.name for d in ckpt.iterdir()}
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert any(r["event"] == "checkpoint" and r["async"] for r in rows)


@pytest.mark.slow
def test_resume_on_another_world_size_is_close(tmp_path):
    train(tmp_path / "straight", "train.epochs=2", *CONSTANT)
    train(tmp_path / "split", "train.epochs=1", *CONSTANT)
    p = train(tmp_path / "split", "train.epochs=2", *CONSTANT, nproc=2)
    assert "strategy ddp x2" in p.stdout and "resuming from" in p.stdout
    a, b = weights(newest(tmp_path / "straight")), weights(newest(tmp_path / "split"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-4)


def test_run_folder_holds_config_metrics_curves_and_checkpoints(ckpt):
    train(ckpt, "train.epochs=2", "train.plot=true", "checkpoint.keep=1")
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".lock",
        "config.yaml",
        "curves.png",
        "metrics.jsonl",
        "step-32",
        "tensorboard",
    ]
    assert (ckpt / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert all(r["train_loss"] > 0 and 0 <= r["test_acc"] <= 1 and r["images_per_s"] > 0 for r in epochs)
    state, meta = saved(ckpt / "step-32"), json.loads((ckpt / "step-32" / "meta.json").read_text())
    assert set(state) == {"model", "optimizer", "scheduler", "train"} and meta["model"] == "tinynet"
    assert meta["classes"] == [f"class{i}" for i in range(10)]
    assert meta["config"]["train"]["epochs"] == 2 and state["train"]["step"] == 32 and state["train"]["epoch"] == 2


def test_eval_command_reproduces_the_final_accuracy(ckpt):
    train(ckpt, "train.epochs=1")
    final = [r for r in map(json.loads, (ckpt / "metrics.jsonl").read_text().splitlines()) if r["event"] == "epoch"][-1]
    p = run(trainer_cmd("eval", str(ckpt / "step-16")))
    assert f"test accuracy {100 * final['test_acc']:.2f}%" in p.stdout and "(200 images)" in p.stdout
    whole = run(trainer_cmd("eval", str(ckpt)))  # the run folder: its newest complete checkpoint
    assert whole.stdout.startswith(f"{ckpt / 'step-16'}: test accuracy {100 * final['test_acc']:.2f}%"), whole.stdout


def test_plain_log_lines_when_not_a_terminal_and_a_bar_on_one(ckpt):
    plain = train(ckpt / "a", "train.epochs=1")
    assert "epoch 1/1 step 4/16 loss" in plain.stdout and "\r" not in plain.stdout
    leader, follower = pty.openpty()
    p = subprocess.Popen(
        trainer_cmd("train", *TINY, f"checkpoint.dir={ckpt / 'b'}", "train.epochs=1"),
        stdout=follower,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env(),
    )
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    assert p.wait(120) == 0
    assert b"\r[" in out and b"img/s" in out


def test_resume_errors_change_nothing(ckpt):
    train(ckpt, "train.epochs=1")
    before = tree_files(ckpt)
    for override, words in [
        ("checkpoint.resume=never", "already holds checkpoints"),
        (f"checkpoint.resume={ckpt / 'step-999'}", "does not exist"),
        ("model.name=resnet18", "holds model 'tinynet' but model.name=resnet18"),
        ("train.batch_size=64", "was saved with train.batch_size=32 but this run has train.batch_size=64"),
    ]:
        p = run(trainer_cmd("train", *TINY, f"checkpoint.dir={ckpt}", "train.epochs=2", override), check=False)
        assert p.returncode == 2, p.stderr
        assert words in p.stderr and "Traceback" not in p.stderr
        assert tree_files(ckpt) == before


@pytest.mark.slow
def test_real_cifar10_jpegs_learn_far_above_chance(tmp_path, jpegs):
    p = run(
        trainer_cmd(
            "train",
            "model.name=tinynet",
            "data.name=imagefolder",
            f"data.dir={jpegs}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.train_subset=10000",
            "data.test_subset=2000",
            "train.batch_size=64",
            "train.epochs=3",
            "optim.lr=0.05",
            "optim.weight_decay=0",
            "train.log_every=100",
            f"checkpoint.dir={tmp_path / 'ck'}",
            "train.plot=false",
        ),
        timeout=900,
    )
    final = [
        r
        for r in map(json.loads, (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines())
        if r["event"] == "epoch"
    ][-1]
    assert final["test_acc"] > 0.35, p.stdout  # chance is 0.10


@pytest.mark.slow
def test_launch_checks_then_runs_torchrun_with_two_cpu_processes(tmp_path):
    p = run(
        [
            sys.executable,
            "-m",
            "trainer",
            "launch",
            "--config",
            "configs/smoke.yaml",
            f"checkpoint.dir={tmp_path / 'ck'}",
            "train.epochs=1",
        ]
    )
    assert "--nproc-per-node=2" in p.stderr and "strategy ddp x2" in p.stdout
    assert (tmp_path / "ck" / "step-32").is_dir()
    bad = run([sys.executable, "-m", "trainer", "launch", "train.batch_size=0"], check=False)
    assert bad.returncode == 2 and "torchrun" not in bad.stderr


def test_profiler_writes_a_trace_a_table_and_a_summary(ckpt):
    train(ckpt / "a", "train.epochs=1", "profile.steps=3", "profile.skip=2")
    rows = [json.loads(line) for line in (ckpt / "a" / "metrics.jsonl").read_text().splitlines()]
    (summary,) = [r for r in rows if r["event"] == "profile"]
    assert summary["steps"] == 3 and summary["wall_ms_per_step"] > 0 and summary["device_busy_ms_per_step"] is None
    parts = summary["host_ms_per_step"]
    assert {"step.data", "step.forward", "step.backward", "step.optimizer", "step.stop_poll"} <= set(parts)
    assert 0 < parts["step.forward"] < summary["wall_ms_per_step"]
    trace = json.loads((ckpt / "a" / "profile-rank0.json").read_text())
    assert any("backward" in e.get("name", "").lower() for e in trace["traceEvents"])
    assert "Self CPU" in (ckpt / "a" / "profile-rank0.txt").read_text()
    # a window that training ends inside is closed and written at the end (16 steps, window 14..19)
    train(ckpt / "b", "train.epochs=1", "profile.steps=6", "profile.skip=14")
    rows = [json.loads(line) for line in (ckpt / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["steps"] for r in rows if r["event"] == "profile"] == [2]


def test_log_lines_come_by_time_too_with_an_eta(ckpt):
    """A slow step (a big model on a CPU) still shows progress: a line once train.log_seconds pass."""
    p = train(ckpt, "train.epochs=1", "train.log_every=1000", "train.log_seconds=0.000001")
    lines = [x for x in p.stdout.splitlines() if x.startswith("epoch 1/1 step ")]
    assert len(lines) == 16 and all(" eta " in x for x in lines), p.stdout
    assert lines[-1].endswith("eta 0m00s")
    quiet = train(ckpt.parent / "quiet", "train.epochs=1", "train.log_every=1000", "train.log_seconds=0")
    assert not [x for x in quiet.stdout.splitlines() if x.startswith("epoch 1/1 step ")]


def test_a_resumed_epochs_figures_say_they_cover_part_of_it(ckpt):
    train(ckpt, "train.epochs=1", "train.max_steps=10", "checkpoint.every_steps=5")
    p = train(ckpt, "train.epochs=1")
    assert "epoch 1/1 | train loss" in p.stdout and "(steps 11-16, after a resume)" in p.stdout, p.stdout
    last = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines() if '"epoch"' in x][-1]
    assert last["resumed_at_epoch_step"] == 10 and last["steps"] == 6


def test_a_resume_from_an_epochs_last_step_only_evaluates_that_epoch(ckpt):
    """Killed after the epoch's last step was saved, before its evaluation: the resumed run has no
    training figures for that epoch to report, and says so instead of a loss of 0 at 0 img/s."""
    killed = train(
        ckpt, "train.epochs=2", "checkpoint.every_steps=16", env=env(TRAINER_FAULT="batch@17:kill"), check=False
    )
    assert killed.returncode == -9 and (ckpt / "step-16").is_dir(), killed.stderr[-2000:]
    p = train(ckpt, "train.epochs=2")
    line = next(x for x in p.stdout.splitlines() if x.startswith("epoch 1/2 |"))
    assert line.startswith("epoch 1/2 | train steps all done before the resume | test acc") and "img/s" not in line, (
        p.stdout
    )
    first = next(
        json.loads(x)
        for x in (ckpt / "metrics.jsonl").read_text().splitlines()
        if '"epoch": 1,' in x and '"event": "epoch"' in x
    )
    assert first["steps"] == 0 and first["train_loss"] is None and first["test_acc"] is not None
    assert "epoch 2/2 | train loss" in p.stdout


def test_the_first_step_is_timed_from_the_command_as_well_as_from_the_worker(ckpt):
    """What a user feels (imports, launcher, data) and what the worker measures, both in the record."""
    t0 = time.time()
    train(ckpt, "train.epochs=1", "train.max_steps=2")
    wall = time.time() - t0
    first = next(json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines() if '"first_step"' in x)
    assert 0 < first["seconds"] < first["since_command_s"] < wall, (first, wall)
