"""trainer eval --report (trainer/worker/report.py): per-class figures, the confusion matrix as a
picture, the most confused pairs and the worst images by path; the same at any world size."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from conftest import env, free_port, run, torchrun_cmd, trainer_cmd

from trainer.worker.report import Report


def test_per_class_figures_and_pairs_come_from_the_confusion_matrix():
    # rows: true a, b, c; columns: predicted
    r = Report(["a", "b", "c"], torch.tensor([[8, 2, 0], [1, 4, 5], [0, 0, 0]]), [], None)
    a, b, c = r.per_class()
    assert (a["images"], a["recall"], a["precision"]) == (10, 0.8, 8 / 9)
    assert (b["recall"], b["precision"]) == (0.4, 4 / 6)
    assert c["images"] == 0 and math.isnan(c["recall"]) and c["precision"] == 0
    assert r.pairs() == [("b", "c", 5, 0.5), ("a", "b", 2, 0.2), ("b", "a", 1, 0.1)]


def test_a_report_names_the_worst_images_by_path_and_draws_the_matrix(small_run, tmp_path):
    run_folder, images = small_run
    p = run(trainer_cmd("eval", str(run_folder), "--report", str(tmp_path / "rep")))
    assert "accuracy (recall)" in p.stdout and "\nall " in p.stdout, p.stdout
    rows = list(csv.DictReader((tmp_path / "rep" / "per_class.csv").open()))
    assert [r["class"] for r in rows] == [f"class{i}" for i in range(10)] and sum(int(r["images"]) for r in rows) == 120
    worst = list(csv.DictReader((tmp_path / "rep" / "worst.csv").open()))
    assert len(worst) == 25 and all(
        w["image"].startswith(str(images / "test")) and f"/{w['true']}/" in w["image"] for w in worst
    )
    probs = [float(w["prob_true"]) for w in worst]
    assert probs == sorted(probs)
    assert (tmp_path / "rep" / "confusion.png").read_bytes()[:4] == b"\x89PNG"
    assert p.stdout.strip().splitlines()[-1].startswith(f"{run_folder}/step-")


@pytest.mark.slow
def test_the_report_of_two_ranks_is_the_report_of_one(small_run, tmp_path):
    run_folder, _ = small_run
    run(trainer_cmd("eval", str(run_folder), "--report", str(tmp_path / "one")))
    run(
        torchrun_cmd(2, "eval", str(run_folder), "--report", str(tmp_path / "two")),
        env=env(MASTER_PORT=str(free_port())),
    )
    for name in ("per_class.csv", "confused_pairs.csv", "worst.csv"):
        assert (tmp_path / "one" / name).read_text() == (tmp_path / "two" / name).read_text(), name
