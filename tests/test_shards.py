"""trainer/worker/data/shards.py: an image folder written as WebDataset shards once, read back by index; bad
input in one line each (real files, real tars, the real CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_jpegs, run, trainer_cmd
from PIL import Image

from trainer.config import ConfigError
from trainer.worker.data import shards


def odd_images(root: Path) -> Path:
    """Class folders whose images are what users have: a transparent PNG, grayscale, CMYK, a
    progressive JPEG, a large photo-sized one, and a file that is no image at all."""
    for split in ("train", "test"):
        for cls, colour in (("alpha", (200, 10, 10)), ("gray", (90, 90, 90)), ("cmyk", (10, 200, 10))):
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i in range(3):
                rgba = Image.new("RGBA", (40, 30), (*colour, 255))
                rgba.paste((0, 0, 0, 0), (0, 0, 20, 30))  # the left half transparent
                rgba.save(d / f"a{i}.png")
                Image.new("L", (30, 40), 90).save(d / f"g{i}.jpg")
                Image.new("CMYK", (36, 36), (0, 255, 0, 0)).save(d / f"c{i}.jpg")
                Image.new("RGB", (1200, 900), colour).save(d / f"p{i}.jpg", progressive=True)
    (root / "train" / "gray" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return root


def test_odd_images_become_rgb_jpegs_and_a_broken_one_is_skipped_and_counted(tmp_path, warned):
    root = odd_images(tmp_path / "img")
    index = shards.write(root, tmp_path / "sh", max_side=256)
    warned(r"skipped 1 unreadable image\(s\) of train: .*broken.jpg")
    train = index["train"]
    assert train["classes"] == ["alpha", "cmyk", "gray"] and train["images"] == 36 and train["skipped"] == 1
    assert json.loads((tmp_path / "sh" / "train.json").read_text())["__kind__"] == "wids-shard-index-v1"
    ds = shards.ShardSet(tmp_path / "sh", "train")
    assert len(ds) == 36
    from torchvision.io import decode_jpeg

    sides = []
    for raw, label, where in ds:
        img = decode_jpeg(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        assert img.shape[0] == 3, where  # RGB, whatever the source
        sides.append(min(img.shape[1:]))
        if where.endswith(("000000000", "000000001", "000000002")):  # the transparent PNGs: the clear half is white
            assert img[:, :, :10].float().mean() > 240 and ds.classes[label] == "alpha"
    assert max(sides) == 256  # the 1200x900 photos scaled down to --max-side


def test_train_and_test_with_other_classes_is_refused(tmp_path):
    root = make_jpegs(tmp_path / "img", train=3, test=2)
    (root / "test" / "class9").rename(root / "test" / "zebra")
    with pytest.raises(ConfigError, match=r"different classes \(only in train: class9; only in test: zebra\)"):
        shards.write(root, tmp_path / "sh")
    assert not list((tmp_path / "sh").iterdir())  # nothing half-written left


def test_a_failed_write_keeps_the_shards_there_were(tmp_path):
    root = make_jpegs(tmp_path / "img", train=3, test=2)
    shards.write(root, tmp_path / "sh")
    before = {f.name: f.read_bytes() for f in (tmp_path / "sh").iterdir()}
    (root / "test" / "class9").rename(root / "test" / "zebra")
    with pytest.raises(ConfigError, match="different classes"):
        shards.write(root, tmp_path / "sh")
    assert {f.name: f.read_bytes() for f in (tmp_path / "sh").iterdir()} == before


def test_missing_cut_or_foreign_shards_are_one_line_and_exit_2(tmp_path):
    root = make_jpegs(tmp_path / "img", train=6, test=2)
    sh = tmp_path / "sh"
    shards.write(root, sh)
    args = ["data.name=shards", f"data.dir={sh}", f"checkpoint.dir={tmp_path / 'ck'}", "model.name=tinynet"]
    tar = next(sh.glob("train-*.tar"))
    whole = tar.read_bytes()
    table = sh / "train.offsets.npy"
    cases = (
        ("cut", "is cut short or replaced"),
        ("gone", "is missing or unreadable"),
        ("no index", "train.json does not exist"),
        ("no offsets", f"{table} is missing; write the shards again"),
        ("bad offsets", f"{table} is damaged ("),
    )
    for damage, words in cases:
        if damage == "no offsets":
            (sh / "train.json.bak").rename(sh / "train.json")
            table.rename(sh / "offsets.bak")
        elif damage == "bad offsets":
            table.write_bytes(b"not numpy")
        elif damage == "cut":
            tar.write_bytes(whole[: len(whole) // 2])
        elif damage == "gone":
            tar.unlink()
        else:
            tar.write_bytes(whole)
            (sh / "train.json").rename(sh / "train.json.bak")
        p = run(trainer_cmd("train", *args), check=False)
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert p.returncode == 2 and len(errors) == 1 and words in errors[0], (damage, p.stderr)
        assert "Traceback" not in p.stderr
    assert "trainer data --shards" in errors[0]


def test_shards_that_fit_train_in_memory_and_the_start_line_names_the_data(tmp_path):
    root = make_jpegs(tmp_path / "img", train=20, test=5, size=48)
    p = run(trainer_cmd("data", "--shards", str(tmp_path / "sh"), "data.name=imagefolder", f"data.dir={root}"))
    assert "200 train and 50 test images, 10 classes" in p.stdout and f"data.dir={tmp_path / 'sh'}" in p.stdout
    p = run(
        trainer_cmd(
            "train",
            "--config",
            "configs/smoke.yaml",
            "data.name=shards",
            f"data.dir={tmp_path / 'sh'}",
            "model.name=airnet",
            "train.epochs=1",
            f"checkpoint.dir={tmp_path / 'ck'}",
        )
    )
    start = next(line for line in (p.stdout + p.stderr).splitlines() if line.startswith("airnet |"))
    assert (
        f"shards {tmp_path / 'sh'}: 200 train / 50 test images, 10 classes, 48 px (auto: the images' median shorter "
        f"side 48 px)" in start
    )
    assert "| in memory, in host memory:" in start
    meta = json.loads((tmp_path / "ck" / "step-3" / "meta.json").read_text())
    assert meta["classes"] == [f"class{c}" for c in range(10)] and meta["config"]["data"]["image_size"] == 48


def test_check_refuses_a_model_that_cannot_take_the_images_before_any_worker_starts(tmp_path):
    root = make_jpegs(tmp_path / "img", train=2, test=1, size=48)
    shards.write(root, tmp_path / "sh")
    args = ["data.name=shards", f"data.dir={tmp_path / 'sh'}", f"checkpoint.dir={tmp_path / 'ck'}"]
    p = run(trainer_cmd("check", *args, "model.name=seednet"), check=False)
    assert p.returncode == 2 and "model.name=seednet cannot take data.image_size=48 images" in p.stderr
    assert run(trainer_cmd("check", *args, "model.name=airnet")).stdout.strip() == "ok"


def test_the_images_config_trains_from_shards(tmp_path):
    """configs/images.yaml (the copy a user starts from), shrunk to seconds on a CPU: a small
    torchvision model, 64 px, two steps."""
    root = make_jpegs(tmp_path / "img", train=4, test=2, size=72)
    shards.write(root, tmp_path / "sh")
    p = run(
        trainer_cmd(
            "train",
            "--config",
            "configs/images.yaml",
            f"data.dir={tmp_path / 'sh'}",
            "model.name=mobilenet_v3_small",
            "data.image_size=64",
            "train.batch_size=16",
            "train.max_steps=2",
            f"checkpoint.dir={tmp_path / 'ck'}",
        )
    )
    out = p.stdout + p.stderr
    assert (
        "mobilenet_v3_small |" in out
        and "40 train / 20 test images, 10 classes, 64 px (data.image_size)" in out
        and "done: step 2" in out
    )


def test_shards_from_tarballs_hold_the_same_images_as_from_the_folder(tmp_path):
    from test_data import tarballs

    root = tarballs(tmp_path, per_class=3)  # set-train.tar.gz and set-test.tar.gz of make_folder's images
    shards.write(root, tmp_path / "from-tars")
    shards.write(tmp_path / "src", tmp_path / "from-folder")
    a, b = shards.ShardSet(tmp_path / "from-tars", "train"), shards.ShardSet(tmp_path / "from-folder", "train")
    assert a.classes == b.classes == ["blue", "green", "red"] and len(a) == len(b) == 9
    assert [a[i][1] for i in range(9)] == [b[i][1] for i in range(9)]
