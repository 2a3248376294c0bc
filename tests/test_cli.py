"""The command line: fast for what needs no torch, one line for every usage error."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, env

PROBE = """
import sys
from trainer.cli import main
try:
    main(sys.argv[1:], prog_name="trainer")
except SystemExit as e:
    code = e.code
print("torch imported:", "torch" in sys.modules, "exit:", code)
"""


@pytest.mark.parametrize(
    "args, code",
    [
        (["--help"], 0),
        (["config", "--explain"], 0),
        (["train", "train.bath_size=64"], 2),
        (["launch", "--config", "configs/nope.yaml"], 2),
        (["check", "train.epochs=many"], 2),
        (["data", "data.name=mnist"], 2),
        (["bench", "--suite", "seednet,nccl"], 2),
    ],
)
def test_help_and_usage_errors_do_not_import_torch(args, code):
    """torch takes seconds to import; `trainer --help`, `trainer config` and usage errors need none of it."""
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT, env=env())
    assert f"torch imported: False exit: {code}" in p.stdout, p.stdout + p.stderr


def test_train_help_shows_an_override_that_runs_and_points_at_explain(tmp_path):
    from conftest import ROOT, run

    text = run([sys.executable, "-m", "trainer", "train", "--help"]).stdout
    example = next(line.strip() for line in text.splitlines() if line.strip().startswith("trainer train --config"))
    assert "Every key, with its type, default and meaning: trainer config --explain" in text
    # as written, from a checkout's root (a fresh one: no checkpoints)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    out = run([sys.executable, "-m", "trainer", *example.split()[1:]], cwd=tmp_path)
    assert "done: step 32" in out.stdout + out.stderr and (tmp_path / "checkpoints" / "smoke" / "step-32").is_dir()


def test_trainer_bench_outside_a_clone_says_where_the_benchmarks_are(tmp_path):
    """The benchmarks (bench/) are not part of the installed package: an install without them (a
    copy of trainer/ alone, as a wheel installs it) refuses in one line and names the fix."""
    import shutil

    shutil.copytree(ROOT / "trainer", tmp_path / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
    p = subprocess.run(
        [sys.executable, "-m", "trainer", "bench", "--suite", "seednet"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**env(), "PYTHONPATH": str(tmp_path)},
    )
    errors = [line for line in p.stderr.splitlines() if line.strip()]
    assert (
        p.returncode == 2
        and len(errors) == 1
        and "clone of the repository (bench/)" in errors[0]
        and "pip install -e ." in errors[0]
    ), p.stderr


def test_launch_checks_a_resume_path_before_it_downloads_or_starts_anything(tmp_path):
    """make run-local ARGS="checkpoint.resume=/nowhere/step-5": the one line comes first, not after a
    download try and a torchrun start."""
    from conftest import run

    p = run(
        [
            sys.executable,
            "-m",
            "trainer",
            "launch",
            "--nproc-per-node",
            "2",
            "--config",
            "auto",
            f"checkpoint.dir={tmp_path / 'ck'}",
            f"data.dir={tmp_path / 'data'}",
            f"checkpoint.resume={tmp_path / 'nowhere' / 'step-5'}",
        ],
        check=False,
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint.resume={tmp_path / 'nowhere' / 'step-5'} does not exist; pass a step-N folder, or "
        f"checkpoint.resume=auto"
    ), p.stderr
    assert "torchrun" not in p.stderr and "download" not in p.stderr.lower() and not (tmp_path / "data").exists(), (
        p.stderr
    )


@pytest.mark.slow
def test_make_run_local_on_a_users_images_picks_what_fits_them_and_says_so_first(tmp_path):
    """make run-local DATA=<120 photos of 96 px>: the CPU job's network takes 32 px only, its batch
    (256) is larger than the set, its run folder holds the CIFAR run. The first line says what
    was fitted; the run trains and ends in a folder named after the images."""
    from conftest import make_jpegs, run

    make_jpegs(tmp_path / "myphotos", train=12, test=3, size=96)
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # from a checkout's root, as make runs it
    p = run(
        [
            sys.executable,
            "-m",
            "trainer",
            "launch",
            "--nproc-per-node",
            "2",
            "--config",
            "auto",
            "data.name=imagefolder",
            f"data.dir={tmp_path / 'myphotos'}",
            "train.epochs=1",
        ],
        cwd=tmp_path,
        timeout=600,
    )
    first = p.stderr.splitlines()[0]
    assert first == (
        f"no GPU here: configs/cpu.yaml, fitted to the images in {tmp_path / 'myphotos'}: model torchvision.resnet18 "
        "(tinynet cannot take 96 px images), batch 16 (120 training images), run folder checkpoints/myphotos; "
        "ARGS= sets any of them"
    ), p.stderr[:2000]
    assert (
        "done: step 7, checkpoints in checkpoints/myphotos" in p.stdout + p.stderr
        and (tmp_path / "checkpoints" / "myphotos" / "step-7").is_dir()
    )
