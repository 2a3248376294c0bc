"""trainer predict (trainer/worker/predict.py): the top-k of files, folders and shards, as a table
and as JSON lines or CSV; unreadable files named, skipped and counted."""

from __future__ import annotations

import csv
import json
import shutil

from conftest import run, trainer_cmd


def test_a_folder_is_read_recursively_and_each_image_gets_its_top_k(small_run, tmp_path):
    run_folder, images = small_run
    p = run(trainer_cmd("predict", str(run_folder), str(images / "test"), "--top-k", "2"))
    rows = p.stdout.strip().splitlines()
    assert len(rows) == 120, p.stdout[-500:]
    name, *top = rows[0].split("\t")
    assert name.endswith(".jpg") and len(top) == 2 and all(t.split()[0].startswith("class") for t in top), rows[0]
    probs = [float(t.split()[1]) for t in top]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0001
    assert p.stderr.strip().splitlines()[-1].startswith(f"120 image(s) predicted by {run_folder}/step-"), p.stderr
    # the trained model beats chance on its own test images: the predictions mean something
    right = sum(f"/{t.split()[0]}/" in n for n, t, _ in (r.split("\t") for r in rows))
    assert right > 120 * 0.3, right


def test_unreadable_files_are_one_line_each_skipped_and_counted(small_run, tmp_path):
    run_folder, images = small_run
    shutil.copytree(images / "test" / "class3", tmp_path / "mine" / "deep" / "class3")
    (tmp_path / "mine" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (tmp_path / "mine" / "cut.png").write_bytes((images / "test" / "class3" / "0.jpg").read_bytes()[:50])
    out = tmp_path / "p.csv"
    p = run(trainer_cmd("predict", str(run_folder), str(tmp_path / "mine"), "--out", str(out), "-q"))
    skipped = [line for line in p.stderr.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 2 and all("not a readable image" in line for line in skipped), p.stderr
    assert "12 image(s) predicted" in p.stderr and "2 skipped (unreadable)" in p.stderr and not p.stdout.strip()
    rows = list(csv.reader(out.open()))
    assert rows[0] == [
        "file",
        "class1",
        "prob1",
        "class2",
        "prob2",
        "class3",
        "prob3",
        "class4",
        "prob4",
        "class5",
        "prob5",
    ]
    assert len(rows) == 13 and all(r[0].startswith(str(tmp_path / "mine" / "deep")) for r in rows[1:])


def test_no_readable_image_at_all_is_bad_input(small_run, tmp_path):
    run_folder, _ = small_run
    (tmp_path / "a.jpg").write_bytes(b"nope")
    p = run(trainer_cmd("predict", str(run_folder), str(tmp_path / "a.jpg")), check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        "error: none of the 1 image(s) could be read (each is named above); give readable images"
    ), p.stderr
    p = run(trainer_cmd("predict", str(tmp_path / "a.jpg"), str(tmp_path / "a.jpg")), check=False)
    assert p.returncode == 2 and "is not a checkpoint or an exported model" in p.stderr, p.stderr
    p = run(trainer_cmd("predict", str(run_folder), str(tmp_path), "--out", str(tmp_path / "p.txt")), check=False)
    assert p.returncode == 2 and "use .jsonl (JSON lines) or .csv" in p.stderr, p.stderr


def test_a_shards_folder_is_predicted_image_by_image(small_run, tmp_path):
    run_folder, images = small_run
    run(trainer_cmd("data", "--shards", str(tmp_path / "shards"), "data.name=imagefolder", f"data.dir={images}"))
    out = tmp_path / "p.jsonl"
    run(trainer_cmd("predict", str(run_folder), str(tmp_path / "shards"), "--out", str(out), "-q", "--top-k", "1"))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 120 + 400 and rows[0]["file"].startswith(f"{tmp_path / 'shards'}/test/")
    assert len(rows[0]["top"]) == 1 and rows[0]["top"][0]["class"].startswith("class")


def test_jpegs_decoded_on_the_device_give_the_predictions_of_the_workers_pil_path(small_run, tmp_path):
    """The GPU's path (nvjpeg and roi_align there; torchvision's CPU decoder here, the same code
    around it) against PIL in the workers, on the same images: the same top-1, probabilities close
    (two JPEG decoders round the IDCT differently); a broken JPEG is named and skipped in both."""
    from trainer.worker.predict import find_images, predict
    from trainer.worker.trained import open_trained

    run_folder, images = small_run
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut")
    refs = find_images([str(images / "test" / "class1"), str(tmp_path / "broken.jpg"), str(images / "test" / "class2")])
    model = open_trained(str(run_folder))
    said = {True: [], False: []}
    got = {raw: list(predict(model, refs, 3, 7, 0, said[raw].append, jpegs_on_device=raw)) for raw in (True, False)}
    assert [p.name for p in got[True]] == [p.name for p in got[False]] and len(got[True]) == 24
    assert [p.top[0][0] for p in got[True]] == [p.top[0][0] for p in got[False]]
    assert max(abs(a.top[0][1] - b.top[0][1]) for a, b in zip(got[True], got[False], strict=True)) < 0.05
    assert len(said[True]) == len(said[False]) == 1 and "broken.jpg" in said[True][0], said
