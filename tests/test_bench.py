"""The benchmark report (bench/run.py) renders what the GPU runs stored; CPU only."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench.run import evict_page_cache, node_files, read_jsonl, table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def stored_rows() -> list[tuple[str, list[dict]]]:
    found = []
    for f in sorted(RESULTS.glob("*.json")):
        data = json.loads(f.read_text())
        if isinstance(data, dict) and data.get("rows"):
            found.append((f.name, data["rows"]))
    return found


def test_the_report_has_a_line_for_every_stored_row():
    files = stored_rows()
    assert len(files) >= 10, "bench/results lost its stored runs"
    for name, rows in files:
        text = table(rows)
        for r in rows:
            shown = r.get("images_per_s") is not None and "batch_per_gpu" in r
            shown = shown or "seconds_to_target" in r or str(r.get("run", "")).startswith("restart-")
            if shown:
                assert f"{r['run']}" in text, f"{name}: {r['run']} is missing from the report"


def test_read_jsonl_skips_blank_lines_and_a_missing_file(tmp_path):
    f = tmp_path / "results.jsonl"
    assert read_jsonl(f) == []
    f.write_text('{"run": "a"}\n\n{"run": "b"}\n')
    assert [r["run"] for r in read_jsonl(f)] == ["a", "b"]


def resident_bytes(path) -> int:
    """The bytes of ``path`` in the page cache (util-linux's fincore)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[0])


def test_a_start_of_the_restart_suite_finds_nothing_in_the_page_cache(tmp_path):
    """The restart suite's fresh node: files read before (by the cold start) are no longer in memory."""
    # a tmpfs keeps its pages
    on_disk = (
        tmp_path
        if "tmpfs" not in subprocess.run(["stat", "-f", "-c", "%T", tmp_path], capture_output=True, text=True).stdout
        else Path("/var/tmp")
    )
    with tempfile.TemporaryDirectory(dir=on_disk) as d:
        check_eviction(Path(d) / "volume")


def check_eviction(volume: Path) -> None:
    (volume / "ck").mkdir(parents=True)
    f = volume / "ck" / "state.pt"
    f.write_bytes(os.urandom(8 << 20))
    os.sync()
    f.read_bytes()
    assert resident_bytes(f) > 0
    assert evict_page_cache(volume) == 8 << 20
    assert resident_bytes(f) == 0
    assert volume in node_files(volume) and any((p / "torch").is_dir() for p in node_files(volume))


def test_the_data_suites_sets_sixteen_times_the_images_over_the_same_shards(tmp_path):
    """The data suite's 16x set (host memory flat as the set grows) reads the same images again."""
    from conftest import make_jpegs

    from bench.data import times16
    from trainer.worker.data.shards import ShardSet, write

    write(make_jpegs(tmp_path / "img", train=3, test=1), tmp_path / "sh")
    times16(tmp_path / "sh", tmp_path / "x16")
    one, big = ShardSet(tmp_path / "sh", "train"), ShardSet(tmp_path / "x16", "train")
    assert len(big) == 16 * len(one) == 480
    assert big[7][:2] == one[7][:2] and big[30 * 15 + 7][:2] == one[7][:2]


def test_the_restore_case_times_a_restore_and_shows_where_it_went(tmp_path):
    """bench.micro restore on the CPU: a checkpoint of two steps restored three times into the
    live run, each time timed, and the profile of the last printed."""
    out = tmp_path / "results.jsonl"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.micro",
            "restore",
            "configs/seed.yaml",
            "model.name=tinynet",
            "train.batch_size=32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "BENCH_OUT": str(out), "BENCH_TMP": str(tmp_path)},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = read_jsonl(out)
    assert row["run"] == "checkpoint-restore" and row["model"] == "tinynet" and row["state_GB"] > 0
    assert len(row["restore_s"]) == 3 and all(s > 0 for s in row["restore_s"])
    assert "checkpointer.py" in p.stdout and "(restore)" in p.stdout  # the profile names the restore's own calls


@pytest.mark.slow
def test_the_predict_bench_times_predict_beside_a_plain_script_and_the_exports(tmp_path):
    """`python -m bench.predict` (BENCHMARKS.md, "Predict and export"), shrunk to a CPU: a row for
    each command, every image predicted by both, both exports checked."""
    import json
    import sys

    from conftest import ROOT, make_jpegs, run

    cifar = tmp_path / "cifar"
    make_jpegs(cifar / "src", train=4, test=2)
    for split in ("train", "test"):
        run(["tar", "czf", str(cifar / f"cifar10-jpeg-{split}.tar.gz"), "-C", str(cifar / "src"), split])
    p = run(
        [
            sys.executable,
            "-m",
            "bench.predict",
            str(tmp_path / "out"),
            "--cifar",
            str(cifar),
            "--images",
            "20",
            "--batch",
            "8",
            "--workers",
            "1",
            "--runtime-batch",
            "4",
        ],
        cwd=ROOT,
        timeout=1200,
    )
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [r["case"].split(",")[0] for r in rows] == [
        "plain",
        "predict",
        "plain",
        "predict",
        "export onnx",
        "export pt2",
        "cpu runtimes",
    ]
    assert all(r["images"] == 20 and r["images_per_s"] > 0 for r in rows[:4])
    assert all("largest logit difference" in r["line"] for r in rows[4:6]) and rows[6]["onnxruntime_images_per_s"] > 0
    # --before TREE: an earlier tree's predict takes turns with this one's (here the same tree)
    p = run(
        [
            sys.executable,
            "-m",
            "bench.predict",
            str(tmp_path / "out"),
            "--cifar",
            str(cifar),
            "--images",
            "20",
            "--batch",
            "8",
            "--workers",
            "1",
            "--before",
            str(ROOT),
            "--predict-only",
        ],
        cwd=ROOT,
        timeout=1200,
    )
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [r["case"].split(",")[0] for r in rows] == ["plain", "predict", "before", "plain", "predict", "before"]


@pytest.mark.slow
def test_the_memory_bench_takes_any_image_size_and_refuses_to_report_a_failed_run(tmp_path):
    """`python -m bench.data --memory SHARDS` on 72-px shards: figures, exit 0. With a shard
    replaced by other bytes the runs fail: no figures, one line naming the case and its error, exit 1."""
    import json
    import sys

    from conftest import ROOT, make_jpegs, run

    from trainer.worker.data.shards import write

    write(make_jpegs(tmp_path / "img", train=30, test=3, size=72), tmp_path / "sh")
    p = run([sys.executable, "-m", "bench.data", "--memory", str(tmp_path / "sh")], cwd=ROOT, timeout=600)
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r["case"] for r in rows] == ["streamed-memory-x1", "streamed-memory-x16"] and all(
        r["rc"] == 0 and r["peak_anonymous_MB"] > 0 for r in rows
    )
    tar = next((tmp_path / "sh").glob("train-*.tar"))
    tar.write_bytes(bytes(tar.stat().st_size))
    p = run([sys.executable, "-m", "bench.data", "--memory", str(tmp_path / "sh")], cwd=ROOT, timeout=600, check=False)
    assert p.returncode == 1 and not p.stdout.strip(), p.stdout
    assert p.stderr.startswith("bench: streamed-memory-x1 failed (exit 2): error: "), p.stderr
    assert "no figures reported" in p.stderr.splitlines()[0]
