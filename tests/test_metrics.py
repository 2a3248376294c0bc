from __future__ import annotations

import re
import sys

import pytest
from conftest import TINY, run

from trainer.worker.metrics import merged


def test_merged_is_the_union_of_intervals():
    """The profile's device-busy time rests on this union."""
    assert merged([(5, 7), (0, 2), (1, 3), (7, 8), (10, 11)]) == [(0, 3), (5, 8), (10, 11)]
    assert merged([(0, 10), (2, 3)]) == [(0, 10)] and merged([]) == []


def scalars(folder, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_curves_continue_across_a_resume_without_doubles(ckpt):
    from conftest import train

    train(ckpt, "train.epochs=1", "train.log_every=4", "checkpoint.every_steps=8")
    assert [s for s, _ in scalars(ckpt, "train/loss")] == [4, 8, 12, 16]
    assert [s for s, _ in scalars(ckpt, "train/lr")] == [4, 8, 12, 16]
    # a crash after step 12 was logged: the newest checkpoint is step-8 (step-16 lost)
    import shutil

    shutil.rmtree(ckpt / "step-16")
    train(ckpt, "train.epochs=2", "train.log_every=4", "checkpoint.every_steps=8")
    steps = [s for s, _ in scalars(ckpt, "train/loss")]
    assert steps == sorted(set(steps)) == list(range(4, 33, 4)), steps
    acc = scalars(ckpt, "epoch/test_acc")
    assert [s for s, _ in acc] == [16, 32] and all(0 <= v <= 1 for _, v in acc)


def test_without_the_tensorboard_package_training_is_silent_about_it(ckpt):
    code = (
        "import sys; sys.modules['torch.utils.tensorboard'] = None\n"
        "from trainer.cli import entry; sys.argv = ['trainer', *sys.argv[1:]]; entry()"
    )
    p = run([sys.executable, "-c", code, "train", *TINY, f"checkpoint.dir={ckpt}", "train.epochs=1"])
    said = (p.stdout + p.stderr).replace(str(ckpt), "CKPT").lower()
    assert "tensorboard" not in said and not (ckpt / "tensorboard").exists()
    assert (ckpt / "step-16").is_dir()


def test_startup_phases_add_up_to_the_time_since_the_start():
    import time

    from trainer.worker.metrics import Startup

    t0 = time.perf_counter()
    clock = Startup(t0)
    time.sleep(0.02)  # duration: of phase a
    clock.mark("a")
    clock.mark("b")
    time.sleep(0.01)  # duration: between the marks
    before = time.perf_counter()
    clock.mark("a")  # a phase met twice adds up
    after = time.perf_counter()
    assert list(clock.phases) == ["a", "b"] and clock.phases["a"] >= 0.03
    # the phases end at the last mark (bracketed, so no tolerance for a loaded machine; 1 ms each for rounding)
    assert before - t0 - 0.002 <= sum(clock.phases.values()) <= after - t0 + 0.002
    assert isinstance(Startup.compile_seconds(), dict)


def test_a_rank_persistently_slower_than_the_median_is_named_and_noise_is_not():
    from trainer.worker.metrics import Stragglers

    class OneHost:
        collectives, world_size = False, 4

    s = Stragglers(OneHost(), [("node0", []), ("node1", []), ("node2", []), ("node3", [])])
    s.last = 0.0
    for t in (5.0, 10.0):
        record, note = s.judge([20.0, 21.0, 44.0, 20.5], now=t)
        assert note == "" and record["slowest_rank"] == 2 and record["own_ms_per_rank"][2] == 44.0
    record, note = s.judge([20.0, 21.0, 44.0, 20.5], now=15.0)  # the third interval in a row, 15 s slow
    assert note == "straggler: rank 2 (node2) 2.1x the others' median for 15 s (3 intervals)" and record[
        "stragglers"
    ] == [2]
    assert s.judge([20.0, 21.0, 20.0, 20.5], now=20.0)[1] == ""  # back in line: the count starts again
    assert all(s.judge([2.0, 2.1, 5.5, 2.0], now=20.0 + 5 * k)[1] == "" for k in range(1, 5))  # 3.5 ms: noise


def test_a_brief_slowdown_over_short_intervals_is_no_straggler_and_a_lasting_one_is():
    """A shared host's hiccup of 1.5 s spans six 0.25-s log intervals: slow in each, but not for long."""
    from trainer.worker.metrics import Stragglers

    class TwoRanks:
        collectives, world_size = False, 2

    s = Stragglers(TwoRanks(), [("node0", []), ("node1", [])])
    s.last = 0.0
    clock = [0.25 * k for k in range(1, 200)]
    notes = [s.judge([40.0, 80.0] if 4 <= k < 10 else [40.0, 40.0], now=t)[1] for k, t in enumerate(clock[:40])]
    assert notes == [""] * 40  # slow in six intervals in a row, 1.5 s: no line
    notes = [s.judge([40.0, 80.0], now=t)[1] for t in clock[40:]]  # twice as slow from 10 s on, lasting
    first = next(i for i, n in enumerate(notes) if n)
    assert 10.0 <= clock[40 + first] - clock[39] < 10.5 and notes[first].startswith("straggler: rank 1 (node1) 2.0x"), (
        notes[first]
    )
    assert all(notes[first:])


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_twice_as_slow_as_its_peers_is_named_at_two_and_three_ranks(world):
    from trainer.worker.metrics import Stragglers

    class Ranks:
        collectives, world_size = False, world

    s = Stragglers(Ranks(), [(f"node{r}", []) for r in range(world)])
    s.last = 0.0
    times = [40.0] * world
    times[world - 1] = 80.0  # twice its peers: with two ranks, 1.33x the mean of both
    notes = [s.judge(times, now=5.0 * k)[1] for k in (1, 2, 3)]
    assert (
        notes[:2] == ["", ""]
        and notes[2] == f"straggler: rank {world - 1} (node{world - 1}) 2.0x the others' median for 15 s (3 intervals)"
    )
    fast = Stragglers(Ranks(), [(f"node{r}", []) for r in range(world)])
    fast.last = 0.0
    assert [fast.judge([40.0, 52.0, 41.0][:world], now=10.0 * k)[1] for k in (1, 2, 3)] == [
        "",
        "",
        "",
    ]  # 1.3x: within bounds


@pytest.mark.slow
def test_a_slowed_rank_is_named_on_the_progress_line_and_a_clean_run_names_none(tmp_path):
    """Two ranks under torchrun; rank 1 sleeps 60 ms before every batch (the fault hook's slow=):
    the progress line names it, metrics.jsonl has every rank's own time; the same run without
    the sleep names nobody."""
    import json

    from conftest import env, torchrun_cmd

    job = ["train", *TINY, "train.epochs=2", "train.log_every=4", "train.plot=false"]
    # 0.4 s a batch for 32 steps: slow for longer than Stragglers.PERSIST_S
    slow = run(
        torchrun_cmd(2, *job, f"checkpoint.dir={tmp_path / 'slow'}"),
        env=env(TRAINER_FAULT="batch:slow=0.4", TRAINER_FAULT_RANK="1"),
    )
    named = [x for x in slow.stdout.splitlines() if "straggler: rank 1 (" in x]
    assert named and re.search(r"the others' median for \d+ s \(\d+ intervals\)", named[0]), slow.stdout[-2000:]
    logs = [
        json.loads(x) for x in (tmp_path / "slow" / "metrics.jsonl").read_text().splitlines() if '"event": "log"' in x
    ]
    assert all(r["slowest_rank"] == 1 and r["own_ms_per_rank"][1] > 350 for r in logs), logs[:2]
    clean = run(torchrun_cmd(2, *job, "train.log_every=8", f"checkpoint.dir={tmp_path / 'clean'}"))
    assert "straggler" not in clean.stdout, clean.stdout[-2000:]


def test_curves_draw_every_log_line_once_and_whole_epoch_ticks_under_a_title():
    from trainer.worker.metrics import draw_curves

    logs = [
        {"step": k, "loss": 2.0 - k / 100, "images_per_s": 1000.0 + k} for k in (10, 20, 30, 20, 30, 40)
    ]  # resumed at 20
    epochs = [
        {"epoch": 1, "step": 25, "train_loss": 1.8, "test_acc": 0.41},
        {"epoch": 2, "step": 50, "train_loss": 1.6, "test_acc": 0.55},
    ]
    fig = draw_curves(logs, epochs, "tinynet on synthetic set: ddp, 2 processes on cpu")
    loss, speed, acc = fig.axes
    assert list(loss.lines[0].get_xdata()) == [10, 20, 30, 40] and list(speed.lines[0].get_ydata()) == [
        1010.0,
        1020.0,
        1030.0,
        1040.0,
    ]
    assert list(acc.lines[0].get_xdata()) == [1, 2] and [round(a, 6) for a in acc.lines[0].get_ydata()] == [41.0, 55.0]
    fig.canvas.draw()
    ticks = [t for t in acc.get_xticks() if acc.get_xlim()[0] <= t <= acc.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert fig._suptitle.get_text() == "tinynet on synthetic set: ddp, 2 processes on cpu"
    assert draw_curves([], [], "") is None


def test_curves_of_a_short_run_show_points_an_empty_panel_says_so_and_accuracy_ends_at_100():
    from trainer.worker.metrics import draw_curves

    epochs = [
        {"epoch": 1, "step": 8, "train_loss": 0.2, "test_acc": 0.97},
        {"epoch": 2, "step": 16, "train_loss": 0.1, "test_acc": 0.995},
    ]
    fig = draw_curves([], epochs, "a short run")
    _, speed, acc = fig.axes
    assert not speed.lines and "no log window yet" in speed.texts[0].get_text()
    assert acc.get_ylim()[1] <= 100.0, acc.get_ylim()
    fig = draw_curves([{"step": 8, "loss": 0.5, "images_per_s": 900.0}], epochs, "one window")
    assert fig.axes[1].lines[0].get_marker() == "o"  # one window: a point that shows


def test_the_others_median_of_each_rank_matches_the_median_taken_without_it():
    import random
    import statistics

    from trainer.worker.metrics import medians_of_the_others

    rng = random.Random(0)
    for _ in range(500):
        v = [float(rng.randint(1, 6)) for _ in range(rng.randint(0, 9))]  # ties included
        assert medians_of_the_others(v) == (
            {r: statistics.median(v[:r] + v[r + 1 :]) for r in range(len(v))} if len(v) > 1 else {}
        ), v


def test_the_progress_line_says_what_a_stall_waited_for_and_that_img_s_leaves_it_out(capsys):
    from trainer.worker.metrics import Progress

    Progress(True).step(0, 4, 10, 100, 1.2345, 512.0, 90.0, stalled_s=61.0)
    assert capsys.readouterr().out.strip() == (
        "epoch 1/4 step 10/100 loss 1.2345 512 img/s eta 1m30s (1m01s stalled waiting for data or other ranks, not "
        "counted in img/s)"
    )


def test_the_start_line_names_the_run_folder(tmp_path):
    p = run([sys.executable, "-m", "trainer", "train", *TINY, "train.epochs=1", f"checkpoint.dir={tmp_path / 'ck'}"])
    start = next(line for line in p.stdout.splitlines() if line.startswith("tinynet | "))
    assert start.endswith(f"starting fresh | run folder {tmp_path / 'ck'}"), start
