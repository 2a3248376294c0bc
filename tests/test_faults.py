"""Fault injection with real processes: SIGKILL, SIGTERM, SIGSTOP, crashes inside a save, damaged
checkpoints and bad input. Each case runs several trials; a table of cases, trials and passes is
printed at the end of the pytest run (tests/conftest.py)."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import (
    TINY,
    env,
    made_once,
    newest,
    record_fault,
    reseal,
    run,
    saved,
    spawn,
    torchrun_cmd,
    trainer_cmd,
    tree_files,
    weights,
    workers,
)

pytestmark = pytest.mark.slow

STEPS = 32  # 2 epochs x 16 steps
JOB = [
    *TINY,
    "train.epochs=2",
    "checkpoint.every_steps=3",
    "train.log_every=1",
    "optim.momentum=0.9",
    "data.crop_padding=4",
    "checkpoint.keep=20",
]
LINE = re.compile(r"epoch (\d+)/\d+ step (\d+)/(\d+)")


def start(ckpt: Path, *overrides: str, restarts: int = 2, extra_env: dict | None = None) -> subprocess.Popen:
    cmd = torchrun_cmd(2, "train", *JOB, f"checkpoint.dir={ckpt}", *overrides, max_restarts=restarts)
    return spawn(cmd, env(**(extra_env or {})))


def global_step(line: str) -> int | None:
    m = LINE.search(line)
    return (int(m.group(1)) - 1) * int(m.group(3)) + int(m.group(2)) if m else None


def drive(agent: subprocess.Popen, on_line=None, timeout: float = 300) -> str:
    """Read the job's output to the end, calling on_line(line) for each line."""
    lines, deadline = [], time.time() + timeout
    for line in agent.stdout:
        lines.append(line)
        if on_line:
            on_line(line)
        if time.time() > deadline:
            agent.kill()
            break
    agent.wait(30)
    return "".join(lines)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The uninterrupted run every faulted run must reproduce bit for bit."""

    def make(ckpt: Path) -> None:
        out = drive(start(ckpt))
        assert f"done: step {STEPS}" in out, out

    return weights(made_once(tmp_path_factory, "faults-reference", make) / f"step-{STEPS}")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@contextmanager
def trial(case: str):
    """One trial of a fault case, counted in the table (a case's trials are tests of their own, run
    side by side by the workers)."""
    try:
        yield
    except BaseException:
        record_fault(case, 1, 0)
        raise
    record_fault(case, 1, 1)


def draws(seed: int, n: int, draw) -> list:
    """n random choices of the trials of a case, the same on every run and every worker."""
    rng = random.Random(seed)
    return [draw(rng) for _ in range(n)]


@pytest.mark.parametrize("target,victim", draws(1, 4, lambda r: (r.randint(4, STEPS - 4), r.randint(0, 1))))
def test_sigkill_of_a_rank_at_a_random_step_restarts_and_matches(tmp_path, reference, target, victim):
    with trial("SIGKILL one of two ranks at a random step (torchrun restarts)"):
        ckpt = tmp_path / "ckpt"
        agent, killed = start(ckpt), []

        def on_line(line):
            step = global_step(line)
            if step is not None and step >= target and not killed:
                ws = workers(agent)
                assert victim in ws, ws
                ws[victim].send_signal(signal.SIGKILL)
                killed.append(step)

        out = drive(agent, on_line)
        assert killed and agent.returncode == 0, out[-2000:]
        assert "resuming from" in out, out[-2000:]
        assert same(weights(newest(ckpt)), reference), "weights differ from the uninterrupted run"


@pytest.mark.parametrize("target", draws(2, 3, lambda r: r.randint(3, STEPS - 3)))
def test_sigterm_stops_every_rank_saves_that_step_and_resumes(tmp_path, reference, target):
    with trial("SIGTERM during training: checkpoint of that step, resume matches"):
        ckpt = tmp_path / "ckpt"
        agent, sent = start(ckpt), []

        def on_line(line):
            step = global_step(line)
            if step is not None and step >= target and not sent:
                agent.send_signal(signal.SIGTERM)  # what kubelet, docker stop and scancel do to PID 1
                sent.append(step)

        out = drive(agent, on_line)
        stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint saved, exit 75", out)
        assert stopped, out[-2000:]
        assert (ckpt / f"step-{stopped.group(1)}" / "meta.json").is_file()
        assert int(stopped.group(1)) >= sent[0]
        out2 = run(torchrun_cmd(2, "train", *JOB, f"checkpoint.dir={ckpt}")).stdout
        assert f"step-{stopped.group(1)}" in out2 and "resuming from" in out2
        assert same(weights(newest(ckpt)), reference)


@pytest.mark.parametrize("save_step", [6, 9])
def test_sigterm_during_a_save(tmp_path, reference, save_step):
    with trial("SIGTERM during a save: both checkpoints complete, resume matches"):
        ckpt = tmp_path / "ckpt"
        agent = start(ckpt, extra_env={"TRAINER_FAULT": f"before-rename@{save_step}:sleep=2"})
        sent = []

        def watch():  # SIGTERM while rank 0 is inside the save (its temporary folder exists)
            deadline = time.time() + 120
            while time.time() < deadline and agent.poll() is None:
                if (ckpt / f".tmp-step-{save_step}").is_dir():
                    agent.send_signal(signal.SIGTERM)
                    sent.append(True)
                    return
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        out = drive(agent)
        watcher.join()
        assert sent, out[-2000:]
        stopped = re.search(r"stopped by SIGTERM at step (\d+)", out)
        assert stopped and (ckpt / f"step-{save_step}").is_dir() and (ckpt / f"step-{stopped.group(1)}").is_dir(), out[
            -2000:
        ]
        run(torchrun_cmd(2, "train", *JOB, f"checkpoint.dir={ckpt}"))
        assert same(weights(newest(ckpt)), reference)


@pytest.mark.parametrize("crash_step", [6, 12])
def test_rank0_killed_between_write_and_rename(tmp_path, reference, crash_step):
    with trial("rank 0 SIGKILLed between write and rename: previous checkpoint used"):
        ckpt = tmp_path / "ckpt"
        out = drive(start(ckpt, extra_env={"TRAINER_FAULT": f"before-rename@{crash_step}:kill"}))
        assert "resuming from" in out and f"step-{crash_step - 3}" in out, out[-2000:]
        assert not list(ckpt.glob(".tmp-*")), "the half-written save was cleaned up"
        assert same(weights(newest(ckpt)), reference)


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, reference, damage):
    with trial("truncated or flipped newest checkpoint: resume from the previous"):
        ckpt = tmp_path / "ckpt"
        assert f"done: step {STEPS}" in drive(start(ckpt))
        state = ckpt / f"step-{STEPS}" / "__0_0.distcp"
        raw = bytearray(state.read_bytes())
        if damage == "truncated":
            raw = raw[: len(raw) // 3]
        else:
            raw[len(raw) // 2] ^= 0x55  # one flipped byte
        state.write_bytes(bytes(raw))
        out = run(torchrun_cmd(2, "train", *JOB, f"checkpoint.dir={ckpt}")).stdout
        assert ("truncated" in out or "checksum" in out) and f"step-{STEPS}" in out, out[-2000:]
        assert "resuming from" in out and "step-30" in out
        assert (ckpt / f"step-{STEPS}.corrupt").is_dir()
        assert same(weights(newest(ckpt)), reference)


@pytest.mark.parametrize("trial_no", [1, 2])
def test_a_silent_rank_times_out_instead_of_hanging(tmp_path, reference, trial_no):
    with trial("a rank stops answering (SIGSTOP): timeout, restart, resume"):
        ckpt = tmp_path / "ckpt"
        agent = start(ckpt, "dist.timeout_s=5")
        stopped = []

        def on_line(line):
            step = global_step(line)
            if step is not None and step >= 8 and not stopped:
                w = workers(agent)[1]
                w.send_signal(signal.SIGSTOP)  # alive but silent
                stopped.append(w)

        t0 = time.time()
        out = drive(agent, on_line, timeout=240)
        assert stopped and agent.returncode == 0, out[-3000:]
        assert re.search(r"(?i)timed? ?out", out), "the collective timeout turned the hang into an error"
        assert "resuming from" in out and time.time() - t0 < 200
        assert same(weights(newest(ckpt)), reference)


# ------------------------------------------------------------------------------------------------
# Bad input: exit code 2, one line naming the fix, and no file changed


def forged(tmp_path: Path, mutate) -> Path:
    """A real checkpoint, its state and what meta.json says of it altered by ``mutate``, and
    re-sealed with matching checksums."""
    from trainer.worker.checkpoint import folder, store

    src = tmp_path / "src"
    run(trainer_cmd("train", *TINY, f"checkpoint.dir={src}", "train.epochs=1"))
    state, about = saved(src / "step-16"), folder.read_meta(src / "step-16")
    mutate(state, about)
    about = {k: about[k] for k in ("model", "classes", "batch_size", "config", "epoch")}
    return store.write_state(state, tmp_path / "forged", 16, 1, about)


def bad_cases(tmp_path: Path) -> list[tuple[str, str, list[str], str]]:
    """(case, subcommand, arguments after the tiny config, words the error must hold)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00not a checkpoint" * 100)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    no_classes = tmp_path / "noclasses"
    (no_classes / "train").mkdir(parents=True)
    (no_classes / "test").mkdir()
    other_model = forged(tmp_path / "m", lambda s, about: about.update(model="resnet18"))
    wrong_shape = forged(tmp_path / "w", lambda s, about: s["model"].update({"0.weight": torch.zeros(8, 3, 3, 3)}))
    return [
        ("unknown config key", "train", ["train.epoks=2"], "did you mean train.epochs"),
        ("mistyped value", "train", ["train.epochs=two"], "train.epochs"),
        ("impossible value", "train", ["optim.lr=-0.1"], "optim.lr"),
        (
            "batch smaller than the world size",
            "launch",
            ["--nproc-per-node=2", "train.batch_size=1"],
            "smaller than the world size 2",
        ),
        (
            "data folder missing",
            "train",
            ["data.name=imagefolder", f"data.dir={tmp_path / 'nowhere'}"],
            "does not exist",
        ),
        (
            "data folder without class folders",
            "train",
            ["data.name=imagefolder", f"data.dir={no_classes}"],
            "no class folders",
        ),
        ("checkpoint of another model", "train", [f"checkpoint.resume={other_model}"], "holds model 'resnet18'"),
        (
            "resume with another global batch",
            "launch",
            ["--nproc-per-node=2", "train.batch_size=64"],
            "count batches of 32",
        ),
        (
            "checkpoint of an incompatible shape",
            "train",
            [f"checkpoint.resume={wrong_shape}"],
            "does not fit model tinynet",
        ),
        ("file that is not a checkpoint", "train", [f"checkpoint.resume={junk}"], "not a trainer checkpoint"),
        ("resume path that does not exist", "train", [f"checkpoint.resume={tmp_path / 'step-7'}"], "does not exist"),
        ("unwritable checkpoint folder", "train", [f"checkpoint.dir={blocker}/ck"], "is not writable"),
        ("read-only file system", "train", ["checkpoint.dir=/proc/trainer-checkpoints"], "is not writable"),
        ("CUDA asked for without a GPU", "train", ["train.strategy=single"], "needs a CUDA GPU"),
        ("NCCL asked for on the CPU", "launch", ["dist.backend=nccl"], "dist.backend=nccl needs CUDA"),
    ]


def test_bad_input_exits_2_with_one_line_and_changes_nothing(tmp_path):
    ckpt = tmp_path / "ck"
    run(trainer_cmd("train", *TINY, f"checkpoint.dir={ckpt}", "train.epochs=1"))  # something to protect
    failures = []
    for case, sub, args, words in bad_cases(tmp_path / "inputs"):
        snapshot = tree_files(tmp_path)
        p = run(trainer_cmd(sub, *TINY, f"checkpoint.dir={ckpt}", *args), check=False)
        lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        ok = (
            p.returncode == 2
            and len(lines) == 1
            and words in lines[0]
            and "Traceback" not in p.stderr
            and tree_files(tmp_path) == snapshot
        )
        record_fault(f"bad input: {case}", 1, int(ok))
        if not ok:
            failures.append(f"{case}: exit {p.returncode}, stderr {p.stderr[-600:]!r}")
    assert not failures, failures


def test_bad_input_under_torchrun_reports_from_rank0_and_fails(tmp_path):
    ckpt = tmp_path / "ck"
    p = run(torchrun_cmd(2, "train", *TINY, f"checkpoint.dir={ckpt}", "train.batch_size=3"), check=False)
    ok = p.returncode != 0 and p.stderr.count("error: train.batch_size=3 is not a multiple of the world size 2") == 1
    record_fault("bad input under torchrun: one message, job fails", 1, int(ok))
    assert ok, p.stderr[-2000:]
    assert tree_files(ckpt) == {}


def test_a_corrupt_image_is_skipped_with_a_warning(tmp_path):
    from test_data import make_folder

    root = make_folder(tmp_path / "d", per_class=8)
    (root / "train" / "red" / "zz-broken.jpg").write_bytes(b"\xff\xd8\xff\xe0garbage")
    p = run(
        trainer_cmd(
            "train",
            "model.name=tinynet",
            "data.name=imagefolder",
            f"data.dir={root}",
            "train.batch_size=8",
            "train.epochs=1",
            f"checkpoint.dir={tmp_path / 'ck'}",
            "train.plot=false",
        )
    )
    ok = (
        "skipped 1 unreadable image" in p.stderr
        and "zz-broken.jpg" in p.stderr
        and (tmp_path / "ck" / "step-3").is_dir()
    )
    record_fault("corrupt image file: skipped with a warning", 1, int(ok))
    assert ok, p.stderr[-2000:]


def test_a_malicious_checkpoint_is_refused_end_to_end(tmp_path):
    """Code in DCP's .metadata (a pickle), with checksums that match."""
    from trainer.worker.checkpoint import store

    marker = tmp_path / "pwned"
    folder = store.write_state({"model": {"0.weight": torch.ones(1)}}, tmp_path / "evil", 1, 1, {"model": "tinynet"})
    payload = f"import os, pickle, sys\nclass E:\n    def __reduce__(self): return (os.system, ('touch {marker}',))\n"
    payload += "sys.stdout.buffer.write(pickle.dumps(E()))\n"
    (folder / ".metadata").write_bytes(
        subprocess.run([sys.executable, "-c", payload], check=True, capture_output=True).stdout
    )
    reseal(folder)
    p = run(
        trainer_cmd("train", *TINY, f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.resume={folder}"), check=False
    )
    ok = p.returncode == 2 and "not a loadable trainer checkpoint" in p.stderr and not marker.exists()
    record_fault("malicious pickle in a checkpoint: refused, code not run", 1, int(ok))
    assert ok, p.stderr[-1500:]
