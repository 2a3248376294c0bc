"""The test harness itself (tests/conftest.py): how `make test-slow` spreads tests over workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, env

CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("repo_conftest", {str(ROOT / "tests" / "conftest.py")!r})
repo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(repo)
pytest_xdist_make_scheduler = repo.pytest_xdist_make_scheduler
"""

TESTS = """
import os, time
from pathlib import Path

def record(name):
    time.sleep(0.3)
    with open(Path(__file__).parent.parent / "ran.txt", "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {name}\\n")
"""


def test_the_long_suite_spreads_tests_but_keeps_the_one_node_slurm_tests_on_one_worker(tmp_path: Path):
    """Under `--dist loadgroup` the tests of a file go to whichever worker is free, but those of
    test_slurm.py (they share one Slurm node) run on one worker, in their order."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(CONFTEST)
    for file, n in (("test_slurm.py", 4), ("test_other.py", 8)):
        body = TESTS + "".join(f"\ndef test_{i}():\n    record('{file}:{i}')\n" for i in range(n))
        (tmp_path / "tests" / file).write_text(body)
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ran = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    slurm = [(worker, name) for worker, name in ran if name.startswith("test_slurm.py")]
    assert len({w for w, _ in slurm}) == 1 and [n for _, n in slurm] == [f"test_slurm.py:{i}" for i in range(4)], ran
    assert len({w for w, n in ran if n.startswith("test_other.py")}) == 2, ran  # a file's tests, side by side


def test_the_gpu_suite_ends_with_one_table_of_its_cases_results_and_figures():
    """`make test-gpu`: one line per case, with what it measured, whichever worker ran it."""
    from conftest import gpu_table

    figures = [
        {"case": "kill-9", "test": "tests/test_gpu.py::test_kill_9[eager]", "recovery_s": 8.71, "date": "2026-12-07"},
        {"case": "restart", "test": "tests/test_gpu.py::test_restart[seed]", "warm_over_cold": 0.27, "cold_s": 53.0},
    ]
    lines = gpu_table(
        [
            ("tests/test_gpu.py::test_kill_9[eager]", "passed"),
            ("tests/test_gpu.py::test_restart[seed]", "failed"),
            ("tests/test_gpu.py::test_resume[fsdp]", "skipped"),
        ],
        figures,
    )
    assert lines[0].split() == ["case", "result", "figures"]
    assert lines[1].split() == ["kill_9[eager]", "passed", "recovery_s", "8.71"]
    assert lines[2].split() == ["restart[seed]", "failed", "warm_over_cold", "0.27,", "cold_s", "53"]
    assert lines[3].split() == ["resume[fsdp]", "skipped"]
