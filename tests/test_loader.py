from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.config_loader import load_config
from trainer.worker.data import synthetic
from trainer.worker.data.loader import Augment, DeviceLoader, HostLoader, eval_batches, eval_shard, random_crop
from trainer.worker.runtime import Runtime

CPU = torch.device("cpu")


def rt(rank: int, world: int) -> Runtime:
    return Runtime("ddp" if world > 1 else "cpu", rank, rank, world, CPU, None)


def labels_of(loader, epoch: int, start: int = 0) -> list[list[int]]:
    return [y.tolist() for _, y, _ in loader.epoch(epoch, start)]


def indexed_split(n: int):
    train, _ = synthetic(n, 1)
    train.labels = torch.arange(n)  # label = index, so batches show which images they hold
    return train


def test_rank_shards_are_disjoint_cover_the_epoch_and_reshuffle():
    split, b, w = indexed_split(256), 16, 2
    per_rank = [
        [i for batch in labels_of(DeviceLoader(split, rt(r, w), b, seed=0), 0) for i in batch] for r in range(w)
    ]
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(256))
    next_epoch = [i for batch in labels_of(DeviceLoader(split, rt(0, w), b, seed=0), 1) for i in batch]
    assert next_epoch != per_rank[0]


def test_device_loader_matches_distributed_sampler_loader():
    split = indexed_split(300)  # not a multiple of the batch: the tail is dropped the same way
    for w in (1, 2, 3):
        for r in range(w):
            dev = DeviceLoader(split, rt(r, w), 10, seed=5)
            host = HostLoader(split, rt(r, w), 10, seed=5, num_workers=0)
            for epoch in (0, 1):  # epoch 1 of the device loader comes from its look-ahead
                assert labels_of(dev, epoch) == labels_of(host, epoch)
            for (_, y, i), (_, y2, i2) in zip(dev.epoch(2), host.epoch(2), strict=True):
                assert torch.equal(i, y) and torch.equal(i2, y2)  # the data-set indices of the batch
            assert labels_of(dev, 1, start=4) == labels_of(host, 1, start=4) == labels_of(dev, 1)[4:]


def test_global_batches_do_not_depend_on_the_world_size():
    split, global_batch = indexed_split(480), 24
    one = labels_of(DeviceLoader(split, rt(0, 1), global_batch, seed=3), 2)
    for w in (2, 3, 4):
        shards = [labels_of(DeviceLoader(split, rt(r, w), global_batch // w, seed=3), 2) for r in range(w)]
        merged = [sorted(sum((s[k] for s in shards), [])) for k in range(len(one))]
        assert merged == [sorted(b) for b in one]


def augment(cfg, rank: int, world: int, batch: int, steps: int = 10, channels_last: bool = False) -> Augment:
    return Augment(cfg, rt(rank, world), channels_last, per_rank_batch=batch, steps_per_epoch=steps)


def test_augmentation_is_a_function_of_seed_epoch_step_and_global_position():
    cfg = load_config(None, ["data.crop_padding=4"])
    x = torch.randint(0, 256, (24, 3, 32, 32), dtype=torch.uint8)  # three steps of 8
    idx = torch.arange(24)
    whole = augment(cfg, 0, 1, 8).train(x[8:16], epoch=1, step=7, idx=idx[8:16])
    assert torch.equal(whole, augment(cfg, 0, 1, 8).train(x[8:16], 1, 7, idx[8:16]))
    assert not torch.equal(whole, augment(cfg, 0, 1, 8).train(x[8:16], 1, 8, idx[8:16]))
    assert not torch.equal(whole, augment(cfg, 0, 1, 8).train(x[8:16], 2, 7, idx[8:16]))
    halves = [augment(cfg, r, 2, 4).train(x[8:16][r::2], 1, 7, idx[8:16][r::2]) for r in range(2)]
    assert torch.equal(halves[0], whole[0::2]) and torch.equal(halves[1], whole[1::2])
    # three steps in one call (as the device loader augments an epoch) = the middle step alone
    assert torch.equal(augment(cfg, 0, 1, 8).train(x, 1, 6, idx)[8:16], whole)
    with pytest.raises(ValueError, match="whole batches"):
        augment(cfg, 0, 1, 8).train(x[:12], 1, 0, idx[:12])


def test_device_and_host_loaders_give_the_same_augmented_batches():
    cfg = load_config(None, ["data.crop_padding=2", "data.crop_mode=reflect", "data.flip_mode=alternate"])
    split = indexed_split(300)
    for w in (1, 2):
        for r in range(w):
            aug = augment(cfg, r, w, 10, steps=300 // (10 * w))
            # 4 steps a chunk
            chunked = DeviceLoader(split, rt(r, w), 10, seed=5, augment=aug, chunk_bytes=4 * 10 * 3 * 32 * 32 * 4)
            host = HostLoader(split, rt(r, w), 10, seed=5, num_workers=0, augment=aug)
            for epoch, start in ((0, 0), (1, 0), (1, 5)):
                dev = list(chunked.epoch(epoch, start))
                hst = list(host.epoch(epoch, start))
                assert len(dev) == len(hst) == chunked.steps_per_epoch - start
                for (x, y, i), (x2, y2, i2) in zip(dev, hst, strict=True):
                    assert x.dtype == torch.float32 and torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(i, i2)


def test_random_crop_equals_padding_then_slicing():
    x = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    shift = torch.randint(0, 9, (6, 2))
    for reflect, mode in ((False, "constant"), (True, "reflect")):
        out = random_crop(x, shift, 4, reflect=reflect)
        padded = F.pad(x.float(), (4, 4, 4, 4), mode=mode).to(torch.uint8)
        ref = torch.stack([padded[i, :, dy : dy + 32, dx : dx + 32] for i, (dy, dx) in enumerate(shift.tolist())])
        assert torch.equal(out, ref)


def test_mirror_is_folded_into_the_crop():
    x = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    shift = torch.randint(0, 9, (6, 2))
    mirror = torch.tensor([True, False, True, True, False, False])
    for reflect in (False, True):
        plain = random_crop(x, shift, 4, reflect)
        assert torch.equal(
            random_crop(x, shift, 4, reflect, mirror), torch.where(mirror.view(-1, 1, 1, 1), plain.flip(3), plain)
        )


def test_alternating_flip_mirrors_each_image_every_other_epoch():
    cfg = load_config(None, ["data.crop_padding=0", "data.flip_mode=alternate"])
    x = torch.randint(0, 256, (400, 3, 32, 32), dtype=torch.uint8)
    idx = torch.randperm(1000)[:400]
    aug = augment(cfg, 0, 1, 400, steps=4)
    plain = aug.normalize(x)
    seen = []
    for epoch in range(4):
        out = aug.train(x, epoch, step=epoch, idx=idx)
        mirrored = torch.tensor([not torch.equal(out[i], plain[i]) for i in range(len(x))])
        assert all(torch.equal(out[i], plain[i].flip(2)) for i in range(len(x)) if mirrored[i])
        seen.append(mirrored)
    assert 0.4 < seen[0].float().mean() < 0.6
    assert torch.equal(seen[1], ~seen[0]) and torch.equal(seen[2], seen[0]) and torch.equal(seen[3], ~seen[0])
    halves = [augment(cfg, r, 2, 200, steps=4).train(x[r::2], 1, 0, idx[r::2]) for r in range(2)]
    assert torch.equal(halves[0], aug.train(x, 1, 0, idx)[0::2])  # the same image gets the same flip on any rank


def test_flip_and_normalise_statistics():
    cfg = load_config(None, ["data.crop_padding=0"])
    x = torch.randint(0, 256, (400, 3, 32, 32), dtype=torch.uint8)
    aug = augment(cfg, 0, 1, 400, steps=1, channels_last=True)
    out = aug.train(x, 0, 0, torch.arange(400))
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    plain = aug.normalize(x)
    flipped = [not torch.equal(out[i], plain[i]) for i in range(len(x))]
    assert all(torch.equal(out[i], plain[i].flip(2)) for i in range(len(x)) if flipped[i])
    assert 0.35 < sum(flipped) / len(x) < 0.65


def test_every_test_image_is_counted_once_whatever_the_world_size():
    for n in (10, 1000, 1001):
        for w in (1, 2, 3, 7):
            shards = [eval_shard(n, rt(r, w)) for r in range(w)]
            assert sorted(i for s in shards for i in s) == list(range(n))
    _, test = synthetic(1, 103)
    counts = [[len(y) for _, y in eval_batches(test, rt(r, 3), 16)] for r in range(3)]
    assert len({len(c) for c in counts}) == 1  # same number of batches on every rank
    assert sum(map(sum, counts)) == 103


def test_epoch_orders_drawn_ahead_are_those_of_their_epoch_in_any_call_order():
    """The next epoch's order comes from a helper thread and two reused buffers; epochs asked for
    out of turn (a resume, a repeat) must still get their own order and no other's."""
    split, b = indexed_split(200), 10
    fresh = {e: labels_of(DeviceLoader(split, rt(1, 2), b, seed=4), e) for e in range(5)}
    loader = DeviceLoader(split, rt(1, 2), b, seed=4)
    for e in (0, 1, 2, 1, 1, 4, 3, 0):
        assert labels_of(loader, e) == fresh[e], f"epoch {e}"
    assert len({str(v) for v in fresh.values()}) == 5


@pytest.mark.parametrize("channels_last", [False, True])
def test_normalize_is_exact_and_in_the_models_layout(channels_last):
    x = torch.randint(0, 256, (5, 3, 8, 8), dtype=torch.uint8)
    aug = Augment(load_config(), rt(0, 1), channels_last)
    out = aug.normalize(x)
    assert torch.equal(out, (x.float() - aug.mean) * aug.inv_std) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert x.is_contiguous()  # the input is left as it was


def test_a_loader_worker_ignores_a_groups_sigterm_and_ends_at_its_parents_exit_after_an_error(tmp_path):
    """torchrun and Slurm send SIGTERM to the whole group: a worker ignores it (its process saves and
    stops). A process that ends on an error whose traceback holds the iterator: multiprocessing's
    exit hook sends the workers SIGTERM and waits, and they end (they used to ignore it: no exit)."""
    import subprocess
    import sys
    import time

    from conftest import ROOT, env

    script = tmp_path / "ends_on_an_error.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "from trainer.worker.data.loader import quiet_worker\n"
        "class D(Dataset):\n"
        "    def __len__(self): return 100\n"
        "    def __getitem__(self, i):\n"
        "        if i == 50: raise ValueError('bad input')\n"
        "        return os.getpid() if i == 0 else i\n"
        "it = iter(DataLoader(D(), batch_size=None, num_workers=1, persistent_workers=True, "
        "worker_init_fn=quiet_worker))\n"
        "worker = next(it)\n"
        "subprocess.run(['kill', '-TERM', str(worker)], check=True)  # another process's SIGTERM, as torchrun's\n"
        "time.sleep(1)\n"
        "os.kill(worker, 0)  # still there\n"
        "print('worker survived', flush=True)\n"
        "try:\n"
        "    for _ in it: pass\n"
        "except ValueError as e:\n"
        "    kept = e\n"
        "    sys.exit(2)\n"
    )
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "worker survived" in p.stdout, p.stdout + p.stderr
    assert time.monotonic() - t0 < 60  # not left waiting on its worker
