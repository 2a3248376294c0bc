"""The benchmark report (trainer/bench/run.py) renders what the GPU runs stored; CPU only."""

import json
from pathlib import Path

from trainer.bench.run import read_jsonl, table

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


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
