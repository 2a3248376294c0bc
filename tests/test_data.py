from __future__ import annotations

import multiprocessing as mp
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import run, trainer_cmd
from PIL import Image

from trainer.config import ConfigError
from trainer.config_loader import load_config
from trainer.worker import data

COLOURS = {"blue": (20, 40, 220), "green": (30, 200, 40), "red": (220, 30, 30)}


def make_folder(root: Path, per_class: int = 4, size: int = 32) -> Path:
    for split in ("train", "test"):
        for name, rgb in COLOURS.items():
            d = root / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.new("RGB", (size, size), rgb).save(d / f"{i}.png" if i % 2 else d / f"{i}.jpg")
    return root


def cfg_for(root: Path, tmp: Path, *extra: str):
    return load_config(None, ["data.name=imagefolder", f"data.dir={root}", f"checkpoint.dir={tmp / 'ck'}", *extra])


def test_synthetic_set_is_cifar_shaped_and_deterministic():
    train, test = data.synthetic(100, 20)
    assert train.images.shape == (100, 3, 32, 32) and train.images.dtype == torch.uint8
    assert test.labels.shape == (20,) and set(train.labels.tolist()) <= set(range(10))
    assert torch.equal(data.synthetic(100, 20)[0].images, train.images)


def test_imagefolder_reads_class_folders_with_labels_in_sorted_order(tmp_path, capsys):
    root = make_folder(tmp_path / "d")
    train, test = data.load(cfg_for(root, tmp_path))
    said = capsys.readouterr().err
    assert f"decoding {root / 'train'} into the uint8 cache" in said and "decoded 12 images of train" in said
    assert train.classes == ["blue", "green", "red"] and len(train) == 12 and len(test) == 12
    for img, label in zip(train.images, train.labels, strict=True):
        mean = img.float().mean(dim=(1, 2))
        assert int(mean.argmax()) == {"blue": 2, "green": 1, "red": 0}[train.classes[label]]


def tarballs(tmp_path: Path, **kw) -> Path:
    """make_folder's splits as set-train.tar.gz and set-test.tar.gz in tmp_path/tars."""
    src = make_folder(tmp_path / "src", **kw)
    root = tmp_path / "tars"
    root.mkdir()
    for split in ("train", "test"):
        with tarfile.open(root / f"set-{split}.tar.gz", "w:gz") as tar:
            tar.add(src / split, arcname=split)
    return root


def test_imagefolder_reads_tarballs_and_resizes(tmp_path):
    root = tarballs(tmp_path, size=40)
    train, _ = data.load(cfg_for(root, tmp_path))
    assert train.images.shape == (12, 3, 32, 32) and train.classes == ["blue", "green", "red"]
    assert list((tmp_path / ".data-cache").glob("*.uint8.pt")), "decoded once into a cache beside the run folders"
    assert not [f for f in root.iterdir() if f.suffix not in (".gz",)], "nothing written among the user's files"


def test_corrupt_images_are_skipped_with_a_warning(tmp_path, warned):
    root = make_folder(tmp_path / "d")
    (root / "train" / "red" / "broken.jpg").write_bytes(b"\xff\xd8not a jpeg")
    train, _ = data.load(cfg_for(root, tmp_path))
    warned("skipped 1 unreadable image.*broken.jpg")
    assert len(train) == 12


def test_missing_or_empty_data_folders_are_usage_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        data.load(cfg_for(tmp_path / "nowhere", tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no train/ folder"):
        data.load(cfg_for(tmp_path / "empty", tmp_path))
    (tmp_path / "flat" / "train").mkdir(parents=True)
    (tmp_path / "flat" / "test").mkdir()
    with pytest.raises(ConfigError, match="no class folders"):
        data.load(cfg_for(tmp_path / "flat", tmp_path))


def test_absent_cifar10_that_cannot_be_fetched_names_the_fix(tmp_path):
    cfg = load_config(None, [f"data.dir={tmp_path / 'c'}", "data.download=false", f"checkpoint.dir={tmp_path / 'ck'}"])
    with pytest.raises(ConfigError, match="CIFAR-10 is not in .* data.name=imagefolder"):
        data.load(cfg)


def _load_in_child(root: str, tmp: str, out) -> None:
    train, _ = data.load(cfg_for(Path(root), Path(tmp)))
    out.put(int(train.images.sum()))


def test_concurrent_processes_share_one_decode(tmp_path):
    root = make_folder(tmp_path / "d", per_class=30)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_load_in_child, args=(str(root), str(tmp_path), q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len({q.get() for _ in procs}) == 1
    cache = tmp_path / ".data-cache"
    assert (
        len(list(cache.glob("*.uint8.pt"))) == 1
        and not list(cache.glob(".*.tmp"))
        and not list(root.glob("*.uint8.pt"))
    )


def test_data_command_prepares_the_cache(tmp_path):
    root = make_folder(tmp_path / "d")
    p = run(trainer_cmd("data", "data.name=imagefolder", f"data.dir={root}", f"checkpoint.dir={tmp_path / 'ck'}"))
    assert "12 train and 12 test images" in p.stdout


@pytest.mark.parametrize("damage", ["truncated", "not a tar"])
def test_a_broken_archive_is_one_line_and_exit_2_for_check_and_launch(tmp_path, damage):
    root = tarballs(tmp_path, per_class=40)
    f = root / "set-train.tar.gz"
    f.write_bytes(
        f.read_bytes()[: f.stat().st_size // 2] if damage == "truncated" else b"<html>404 not found</html>" * 50
    )
    args = ["data.name=imagefolder", f"data.dir={root}", f"checkpoint.dir={tmp_path / 'ck'}"]
    for cmd in (
        trainer_cmd("check", *args),
        trainer_cmd("launch", "--nproc-per-node", "1", *args),
        trainer_cmd("data", *args),
    ):
        p = run(cmd, check=False)
        assert p.returncode == 2, (cmd, p.stdout, p.stderr)
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert (
            len(errors) == 1
            and "set-train.tar.gz is not a complete .tar.gz archive" in errors[0]
            and "copy it again" in errors[0]
        ), p.stderr
        assert "Traceback" not in p.stderr and "Aborted" not in p.stderr + p.stdout


def test_a_damaged_cache_is_rebuilt_with_a_warning(tmp_path, warned):
    root = make_folder(tmp_path / "d")
    cfg = cfg_for(root, tmp_path)
    first, _ = data.load(cfg)
    cache = next((tmp_path / ".data-cache").glob("*.uint8.pt"))
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 3])
    again, _ = data.load(cfg)
    warned("is damaged .*decoding the data set again")
    assert torch.equal(again.images, first.images) and torch.equal(again.labels, first.labels)
    assert torch.equal(data.load(cfg)[0].images, first.images)  # and the new cache loads


def test_a_folder_of_only_unreadable_images_says_so(tmp_path):
    root = make_folder(tmp_path / "d")
    for f in (root / "train").rglob("*.*"):
        f.write_bytes(b"not an image")
    with pytest.raises(
        ConfigError, match=r"train: none of its 12 image files could be decoded \(first: .*\); replace them"
    ):
        data.load(cfg_for(root, tmp_path))


def test_image_size_auto_is_the_median_shorter_side_at_most_224_and_set_wins(tmp_path):
    root = make_folder(tmp_path / "d", size=48)
    cfg = cfg_for(root, tmp_path)
    assert data.resolve_image_size(cfg) == (48, "auto: the images' median shorter side 48 px")
    big = make_folder(tmp_path / "big", per_class=2, size=300)
    assert data.resolve_image_size(cfg_for(big, tmp_path))[0] == 224
    assert data.resolve_image_size(cfg_for(big, tmp_path, "data.image_size=160")) == (160, "data.image_size")
    assert data.resolve_image_size(load_config(None, []))[0] == 32  # CIFAR-10 keeps its own


def test_large_images_are_stored_at_8_7_of_the_size_resized_and_centre_cropped(tmp_path):
    root = tmp_path / "d"
    for split in ("train", "test"):
        for name, rgb in COLOURS.items():
            (root / split / name).mkdir(parents=True)
            im = Image.new("RGB", (200, 100), rgb)  # wide: its centre is kept, the sides cut
            im.paste((255, 255, 255), (0, 0, 50, 100))
            im.save(root / split / name / "0.png")
    plan = data.plan(cfg := cfg_for(root, tmp_path, "data.image_size=84"), None, 1)
    train, _ = data.load(cfg)
    assert data.store_size(84) == 96 and train.images.shape == (3, 3, 96, 96)
    assert train.images[:, :, :, :4].float().mean() < 250  # the white left quarter was cut away
    assert "84 px (data.image_size)" in plan.describe(3, 3, 3) and "in memory, in host memory" in plan.path_why
    auto = cfg_for(root, tmp_path)  # data.image_size=0: the set's own, resolved by the plan
    assert data.plan(auto, None, 1).image_size > 0 and auto.data.image_size == 0  # returned; the config is the caller's


def test_grayscale_cmyk_and_transparent_images_load_as_rgb(tmp_path, warned):
    from test_shards import odd_images

    root = odd_images(tmp_path / "d")
    train, test = data.load(cfg_for(root, tmp_path, "data.image_size=32"))
    warned("skipped 1 unreadable")
    assert train.images.shape == (36, 3, 32, 32) and train.classes == ["alpha", "cmyk", "gray"]
    alpha = train.images[train.labels == 0][:3]  # the PNGs: their clear left half is white, not black
    assert alpha[:, :, :, :12].float().mean() > 240


def test_classes_that_differ_or_an_empty_class_folder_are_one_line(tmp_path):
    root = make_folder(tmp_path / "d")
    (root / "test" / "red").rename(root / "test" / "rouge")
    with pytest.raises(
        ConfigError,
        match=r"different classes \(only in train: red; only in test: rouge\); give both the same class folders",
    ):
        data.load(cfg_for(root, tmp_path))
    root = make_folder(tmp_path / "e")
    (root / "train" / "purple").mkdir()
    with pytest.raises(
        ConfigError, match=r"class folder .*train/purple holds no images .*; add images or remove the folder"
    ):
        data.load(cfg_for(root, tmp_path))


def test_the_path_is_decided_by_the_decoded_size_against_the_memory(tmp_path, monkeypatch):
    from trainer.worker.data import shards

    root = make_folder(tmp_path / "d", per_class=10, size=40)
    shards.write(root, tmp_path / "sh")
    cfg = cfg_for(tmp_path / "sh", tmp_path, "data.name=shards")
    need = 60 * 3 * 40 * 40
    assert not data.plan(cfg, need * 10 * 3, 1).stream  # 40 % of it is room enough
    small = data.plan(cfg_for(tmp_path / "sh", tmp_path, "data.name=shards"), need * 2, 1)
    assert (
        small.stream
        and "streamed from shards, JPEGs decoded by the CPU workers" in small.path_why
        and "GiB decoded > 40% of the GPU's" in small.path_why
    )
    monkeypatch.setattr(data, "DATA_MEMORY_SHARE", 1e-9)  # a folder too large for memory: shard it first
    with pytest.raises(
        ConfigError, match=r"needs .* GiB decoded, more than .*; shard it once with `trainer data --shards OUT"
    ):
        data.plan(cfg_for(root, tmp_path), None, 1)
    with pytest.raises(ConfigError, match="data.loader=stream reads shards"):
        data.plan(cfg_for(root, tmp_path, "data.loader=stream"), None, 1)


def test_a_checkpoint_of_other_classes_is_refused_by_resume_and_eval_in_one_line(tmp_path):
    a = make_folder(tmp_path / "a", per_class=12)
    b = make_folder(tmp_path / "b", per_class=12)
    for split in ("train", "test"):
        (b / split / "red").rename(b / split / "yellow")
    job = [
        "--config",
        "configs/smoke.yaml",
        "data.name=imagefolder",
        "train.epochs=1",
        "train.batch_size=12",
        f"checkpoint.dir={tmp_path / 'ck'}",
    ]
    run(trainer_cmd("train", *job, f"data.dir={a}"))
    for cmd in (
        trainer_cmd("train", *job, f"data.dir={b}"),
        trainer_cmd("eval", str(tmp_path / "ck"), f"data.dir={b}"),
    ):
        p = run(cmd, check=False)
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert p.returncode == 2 and len(errors) == 1, (cmd, p.stderr)
        assert (
            "was trained on other classes ('red' is 'yellow' here); point data.dir at the data it was trained on"
            in errors[0]
        )
    p = run(trainer_cmd("eval", str(tmp_path / "ck"), f"data.dir={a}"))
    assert "test accuracy" in p.stdout


def test_a_16_bit_png_trains_as_its_image_scaled_to_8_bits_and_float_pixels_are_named_and_skipped(tmp_path, warned):
    """PIL's own convert clips 16-bit pixels: every value above 255 would train as white."""
    import numpy as np

    root = make_folder(tmp_path / "d")
    ramp = (np.arange(32 * 32, dtype=np.uint16).reshape(32, 32) * 64).astype("<u2")  # 0 .. 65472, a 16-bit ramp
    Image.frombytes("I;16", (32, 32), ramp.tobytes()).save(root / "train" / "red" / "deep.png")
    Image.fromarray(ramp.astype(np.float32)).save(root / "train" / "red" / "float.tif")
    train, _ = data.load(cfg_for(root, tmp_path))
    warned(r"skipped 1 unreadable image.*float.tif")
    deep = train.images[next(i for i, p in enumerate(train.paths) if p.endswith("deep.png"))]
    expect = torch.from_numpy((ramp / 257).round().astype(np.uint8))
    assert all((deep[c].int() - expect.int()).abs().max() <= 1 for c in range(3)), deep[0, :2, :8]
