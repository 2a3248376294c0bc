"""trainer/worker/data/stream.py: the streamed path keeps the in-memory path's exactness. Global batch k holds
the same images at any world size, a resume continues the order with no image skipped or seen
twice (real torchrun, 2 processes then 3), and a damaged JPEG inside a shard is skipped, counted,
and past data.max_bad_images stops the run with exit 2."""

from __future__ import annotations

import tarfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import ROOT, env, make_jpegs, run, torchrun_cmd, trainer_cmd
from test_shards import odd_images

from trainer.config import ConfigError
from trainer.worker.data.loader import crop_boxes, epoch_order
from trainer.worker.data.shards import ShardSet, write
from trainer.worker.data.stream import StepBatches


@pytest.fixture
def shard_dir(tmp_path) -> Path:
    write(make_jpegs(tmp_path / "img", train=12, test=3, size=40), tmp_path / "sh")  # 120 train images
    return tmp_path / "sh"


def global_batch(sh: Path, world: int, epoch: int, step: int, per_rank: int) -> tuple[list[int], torch.Tensor]:
    """Every rank's part of one global step, put back in global order: ids and images."""
    parts = [
        StepBatches(ShardSet(sh, "train"), r, world, per_rank, seed=3, size=24, flip=True, on_cpu=True)[(epoch, step)]
        for r in range(world)
    ]
    ids, images = [0] * (per_rank * world), [None] * (per_rank * world)
    for r, (x, _, idx, _) in enumerate(parts):
        for j in range(per_rank):
            ids[j * world + r], images[j * world + r] = int(idx[j]), x[j]
    return ids, torch.stack(images)


def test_a_global_batch_is_the_same_images_and_crops_at_any_world_size(shard_dir):
    for epoch, step in ((0, 0), (1, 5)):
        ids1, x1 = global_batch(shard_dir, 1, epoch, step, 12)
        for world in (2, 3):
            ids, x = global_batch(shard_dir, world, epoch, step, 12 // world)
            assert ids == ids1 and torch.equal(x, x1)
        assert ids1 == epoch_order(120, 3, epoch)[step * 12 : (step + 1) * 12].tolist()  # the in-memory loaders' order
    assert global_batch(shard_dir, 1, 0, 0, 12)[0] != global_batch(shard_dir, 1, 1, 0, 12)[0]  # a new order every epoch


def test_crop_boxes_stay_inside_the_image_with_torchvisions_area_and_ratio():
    u = torch.rand(4000, 4, generator=torch.Generator().manual_seed(0))
    h, w = torch.full((4000,), 300), torch.full((4000,), 500)
    top, left, ch, cw = crop_boxes(u, h, w).unbind(1)
    assert (top >= 0).all() and (left >= 0).all() and (top + ch <= 300).all() and (left + cw <= 500).all()
    area = (ch * cw).float() / (300 * 500)
    assert area.min() >= 0.07 and area.max() <= 1.0 and 0.4 < area.median() < 0.65
    assert torch.equal(crop_boxes(u, h, w), crop_boxes(u.clone(), h, w))  # four numbers and the size decide a box


def damage_one_jpeg(sh: Path) -> str:
    """Overwrite the middle of the first training JPEG inside its shard (the tar stays valid)."""
    tar_path = next(sh.glob("train-*.tar"))
    with tarfile.open(tar_path) as tar:
        member = next(m for m in tar if m.name.endswith(".jpg"))
    data = bytearray(tar_path.read_bytes())
    start = member.offset_data + 2
    data[start : start + member.size - 4] = b"\x00" * (member.size - 4)
    tar_path.write_bytes(bytes(data))
    return f"{tar_path.name}:{member.name.split('.')[0]}"


def test_a_damaged_jpeg_in_a_shard_is_skipped_counted_and_past_the_limit_stops(shard_dir, capsys):
    from trainer.config_loader import load_config
    from trainer.worker.data.loader import Augment
    from trainer.worker.data.stream import Streamed, StreamLoader
    from trainer.worker.runtime import setup, teardown

    name = damage_one_jpeg(shard_dir)
    base = [
        "data.name=shards",
        f"data.dir={shard_dir}",
        "data.image_size=24",
        "train.batch_size=120",
        "data.stream_workers=1",
        "train.strategy=cpu",
        "checkpoint.dir=/tmp/unused",
    ]
    for limit, stops in ((1, False), (0, True)):
        cfg = load_config(None, [*base, f"data.max_bad_images={limit}"])
        rt = setup(cfg)
        try:
            loader = StreamLoader(
                Streamed(shard_dir, "train"), cfg, rt, 120, Augment(cfg, rt, False, 120, 1), gpu_decode=False
            )
            if stops:
                with pytest.raises(
                    ConfigError,
                    match=r"1 images did not decode on rank 0 \(past data.max_bad_images=0; last in train-000000.tar\)",
                ):
                    list(loader.epoch(0))
                continue
            ((x, y, idx),) = list(loader.epoch(0))
        finally:
            teardown()
        assert x.shape == (120, 3, 24, 24) and len(set(idx.tolist())) == 120  # the batch keeps its shape
        assert f"rank 0: skipped 1 image(s) that do not decode ({name}); 1 so far" in capsys.readouterr().err


def test_random_bytes_in_a_shards_place_stop_the_run_in_one_line_naming_it(shard_dir, tmp_path):
    """The error comes from a DataLoader worker, which wraps it in its traceback: the console gets
    the error's own line, exit 2 (bad input)."""
    import os

    tar = next(shard_dir.glob("train-*.tar"))
    tar.write_bytes(os.urandom(tar.stat().st_size))
    p = run(
        [
            *trainer_cmd(
                "train",
                "data.name=shards",
                f"data.dir={shard_dir}",
                "data.loader=stream",
                "data.stream_workers=1",
                "train.batch_size=40",
                "train.epochs=1",
                "model.name=tinynet",
                "data.image_size=32",
                "model.compile=false",
                "train.plot=false",
                f"checkpoint.dir={tmp_path / 'ck'}",
            )
        ],
        check=False,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out and "DataLoader worker" not in out, out[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: no image of a batch decodes (first: {tar.name}:"), (
        p.stderr[-1000:]
    )
    assert f"{tar.name} is damaged or not a shard; write the shards again with trainer data --shards" in p.stderr


def test_odd_images_stream_as_rgb(tmp_path):
    from trainer.worker.data.stream import decode_crop_cpu, read

    write(odd_images(tmp_path / "img"), tmp_path / "sh", max_side=128)
    raws, labels, where = read(ShardSet(tmp_path / "sh", "train"), range(36))
    x, y, bad = decode_crop_cpu(raws, labels, where, 32, None, False)
    assert x.shape == (36, 3, 32, 32) and not bad and torch.equal(y, labels)


def test_the_gpu_paths_batch_crop_matches_the_cpu_workers_per_image_crops(tmp_path, shard_dir):
    """decode_on_gpu's logic, run on the CPU (the GPU suite runs it with nvjpeg): one buffer from
    the worker, one roi_align for the batch (in chunks, images of mixed sizes padded), a damaged
    JPEG replaced as the CPU workers replace it."""
    from trainer.worker.data.stream import (
        boxes,
        crop_batch,
        crop_resize,
        decode_cpu,
        decode_crop_cpu,
        decode_on_gpu,
        read,
        step_uniforms,
    )

    name = damage_one_jpeg(shard_dir)
    buf, labels, idx, u, where = StepBatches(
        ShardSet(shard_dir, "train"), 0, 1, 24, seed=3, size=24, flip=True, on_cpu=False
    )[(0, 0)]
    assert buf[0].dim() == 1 and sum(buf[1]) == buf[0].numel()  # one buffer, its parts' lengths
    x, y, bad = decode_on_gpu(buf, labels.clone(), where, 24, torch.device("cpu"), u, True)
    cx, cy, cbad = decode_crop_cpu(
        read(ShardSet(shard_dir, "train"), idx.tolist())[0], labels.clone(), where, 24, u, True
    )
    assert x.dtype == torch.float and x.shape == cx.shape == (24, 3, 24, 24) and torch.equal(y, cy) and bad == cbad
    assert name not in where or bad == [name]
    assert (x - cx.float()).abs().mean() < 3  # 0-255 levels: averaged bilinear samples against an antialiased resize

    write(odd_images(tmp_path / "odd"), tmp_path / "odd-sh", max_side=128)
    raws, _, _ = read(ShardSet(tmp_path / "odd-sh", "train"), range(12))
    images = [decode_cpu(r) for r in raws]
    assert len({im.shape for im in images}) > 1  # mixed sizes: padded into one batch
    at, mirror = boxes(images, 32, step_uniforms(0, 0, 0, 12), True)
    per_image = torch.stack([crop_resize(im, at[j], 32, mirror[j]) for j, im in enumerate(images)]).float()
    whole, chunked = (
        crop_batch(images, at, mirror, 32),
        crop_batch(images, at, mirror, 32, chunk_values=2 * 3 * 128 * 200),
    )
    assert torch.equal(whole, chunked) and (whole - per_image).abs().mean() < 3


def test_the_gpu_paths_decode_ahead_thread_keeps_order_stops_cleanly_and_raises_where_it_happened(shard_dir, capsys):
    """DecodeAhead, the GPU path's thread, run on the CPU: the same batches in the same order as the
    workers' decode, an epoch left early leaves no thread behind, and a damaged image past the limit
    raises on the training thread."""
    import threading

    from trainer.config_loader import load_config
    from trainer.worker.data.loader import Augment
    from trainer.worker.data.stream import Streamed, StreamLoader
    from trainer.worker.runtime import setup, teardown

    base = [
        "data.name=shards",
        f"data.dir={shard_dir}",
        "data.image_size=24",
        "train.batch_size=20",
        "data.stream_workers=2",
        "train.strategy=cpu",
        "checkpoint.dir=/tmp/unused",
    ]
    cfg = load_config(None, base)
    rt = setup(cfg)
    try:

        def loader(ahead: bool) -> StreamLoader:
            return StreamLoader(
                Streamed(shard_dir, "train"), cfg, rt, 20, Augment(cfg, rt, True, 20, 6), gpu_decode=ahead
            )

        plain, ahead = list(loader(False).epoch(1)), list(loader(True).epoch(1))
        assert len(plain) == len(ahead) == 6
        for (x, y, i), (xa, ya, ia) in zip(plain, ahead, strict=True):
            assert torch.equal(y, ya) and torch.equal(i, ia) and (x - xa).abs().mean() < 0.1
        early = loader(True)
        for k, _ in enumerate(early.epoch(0)):
            if k == 1:
                break  # the generator is closed here, as when a run stops mid-epoch
        assert not any(t.name == "gpu-decode-ahead" for t in threading.enumerate())
        assert len(list(early.epoch(0, start_step=4))) == 2  # the next iterator reads on
    finally:
        teardown()
    damage_one_jpeg(shard_dir)
    cfg = load_config(None, [*base, "data.max_bad_images=0", "train.batch_size=120"])
    rt = setup(cfg)
    try:
        with pytest.raises(ConfigError, match=r"past data.max_bad_images=0"):
            list(
                StreamLoader(
                    Streamed(shard_dir, "train"), cfg, rt, 120, Augment(cfg, rt, False, 120, 1), gpu_decode=True
                ).epoch(0)
            )
    finally:
        teardown()
    assert not any(t.name == "gpu-decode-ahead" for t in threading.enumerate())


@pytest.mark.slow
def test_a_resume_at_another_world_size_continues_the_order_with_every_image_once(tmp_path, shard_dir):
    """Real torchrun: 2 processes train 7 steps of the 10-step epoch and stop, 3 processes resume
    from that checkpoint and finish 2 epochs. Every image of each epoch trains exactly once, step
    by step the same global batches as one process trains."""
    job = [
        "--config",
        "configs/smoke.yaml",
        "data.name=shards",
        f"data.dir={shard_dir}",
        "data.loader=stream",
        "data.image_size=32",
        "train.batch_size=12",
        "train.epochs=2",
        "data.stream_workers=1",
        "train.plot=false",
        "train.tensorboard=false",
    ]

    def steps(folder: Path) -> dict[tuple[int, int], list[int]]:
        out: dict[tuple[int, int], list[int]] = {}
        for f in sorted(folder.glob("samples-rank*.txt")):
            for line in f.read_text().splitlines():
                epoch, step, *ids = map(int, line.split())
                out.setdefault((epoch, step), []).extend(ids)
        return out

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    run(
        ["python", "-m", "trainer", "train", *job, f"checkpoint.dir={tmp_path / 'ck1'}"],
        env=env(TRAINER_SAMPLE_TRACE=str(one)),
        cwd=ROOT,
    )
    run(
        torchrun_cmd(2, "train", *job, "train.max_steps=7", f"checkpoint.dir={tmp_path / 'ck2'}"),
        env=env(TRAINER_SAMPLE_TRACE=str(two)),
        cwd=ROOT,
    )
    assert max(steps(two)) == (0, 6)
    p = run(
        torchrun_cmd(3, "train", *job, f"checkpoint.dir={tmp_path / 'ck2'}"),
        env=env(TRAINER_SAMPLE_TRACE=str(two)),
        cwd=ROOT,
    )
    assert "resuming from" in p.stdout + p.stderr and "(epoch 0, step 7)" in p.stdout + p.stderr
    reference, resumed = steps(one), steps(two)
    assert sorted(resumed) == sorted(reference) and len(reference) == 20
    for key, ids in reference.items():
        assert sorted(resumed[key]) == sorted(ids), key  # the same global batch, step by step
    for epoch in (0, 1):
        seen = Counter(i for (e, _), ids in resumed.items() if e == epoch for i in ids)
        assert len(seen) == 120 and set(seen.values()) == {1}  # every image once, none skipped or twice
