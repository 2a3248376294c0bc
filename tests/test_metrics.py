from __future__ import annotations

import sys

from conftest import TINY, run

from trainer.metrics import merged


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
    code = ("import sys; sys.modules['torch.utils.tensorboard'] = None\n"
            "from trainer.cli import entry; sys.argv = ['trainer', *sys.argv[1:]]; entry()")
    p = run([sys.executable, "-c", code, "train", *TINY, f"checkpoint.dir={ckpt}", "train.epochs=1"])
    said = (p.stdout + p.stderr).replace(str(ckpt), "CKPT").lower()
    assert "tensorboard" not in said and not (ckpt / "tensorboard").exists()
    assert (ckpt / "step-16").is_dir()


def test_startup_phases_add_up_to_the_time_since_the_start():
    import time

    from trainer.metrics import Startup

    t0 = time.perf_counter()
    clock = Startup(t0)
    time.sleep(0.02)
    clock.mark("a")
    clock.mark("b")
    time.sleep(0.01)
    clock.mark("a")  # a phase met twice adds up
    assert list(clock.phases) == ["a", "b"] and clock.phases["a"] >= 0.03
    assert abs(sum(clock.phases.values()) - (time.perf_counter() - t0)) < 0.01
    assert isinstance(Startup.compile_seconds(), dict)
