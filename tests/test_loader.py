from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.config import load_config
from trainer.data import synthetic
from trainer.dist import Runtime
from trainer.loader import Augment, DeviceLoader, HostLoader, eval_batches, eval_shard, random_crop

CPU = torch.device("cpu")


def rt(rank: int, world: int) -> Runtime:
    return Runtime("ddp" if world > 1 else "cpu", rank, rank, world, world, CPU, None)


def labels_of(loader, epoch: int, start: int = 0) -> list[list[int]]:
    return [y.tolist() for _, y, _ in loader.epoch(epoch, start)]


def indexed_split(n: int):
    train, _ = synthetic(n, 1)
    train.labels = torch.arange(n)  # label = index, so batches show which images they hold
    return train


def test_rank_shards_are_disjoint_cover_the_epoch_and_reshuffle():
    split, b, w = indexed_split(256), 16, 2
    per_rank = [[i for batch in labels_of(DeviceLoader(split, rt(r, w), b, seed=0), 0) for i in batch] for r in range(w)]
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


def test_augmentation_is_a_function_of_seed_epoch_step_and_global_position():
    cfg = load_config(None, ["data.crop_padding=4"])
    x = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    whole = Augment(cfg, rt(0, 1), channels_last=False).train(x, epoch=1, step=7)
    again = Augment(cfg, rt(0, 1), channels_last=False).train(x, epoch=1, step=7)
    assert torch.equal(whole, again)
    assert not torch.equal(whole, Augment(cfg, rt(0, 1), False).train(x, epoch=1, step=8))
    halves = [Augment(cfg, rt(r, 2), False).train(x[r::2], epoch=1, step=7) for r in range(2)]
    assert torch.equal(halves[0], whole[0::2]) and torch.equal(halves[1], whole[1::2])


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
        assert torch.equal(random_crop(x, shift, 4, reflect, mirror), torch.where(mirror.view(-1, 1, 1, 1), plain.flip(3), plain))


def test_alternating_flip_mirrors_each_image_every_other_epoch():
    cfg = load_config(None, ["data.crop_padding=0", "data.flip_mode=alternate"])
    x = torch.randint(0, 256, (400, 3, 32, 32), dtype=torch.uint8)
    idx = torch.randperm(1000)[:400]
    aug = Augment(cfg, rt(0, 1), channels_last=False)
    plain = aug.normalize(x)
    seen = []
    for epoch in range(4):
        out = aug.train(x, epoch, step=epoch * 3, idx=idx)
        mirrored = torch.tensor([not torch.equal(out[i], plain[i]) for i in range(len(x))])
        assert all(torch.equal(out[i], plain[i].flip(2)) for i in range(len(x)) if mirrored[i])
        seen.append(mirrored)
    assert 0.4 < seen[0].float().mean() < 0.6
    assert torch.equal(seen[1], ~seen[0]) and torch.equal(seen[2], seen[0]) and torch.equal(seen[3], ~seen[0])
    halves = [Augment(cfg, rt(r, 2), False).train(x[r::2], 1, 0, idx[r::2]) for r in range(2)]
    assert torch.equal(halves[0], aug.train(x, 1, 0, idx)[0::2])  # the same image gets the same flip on any rank
    with pytest.raises(ValueError, match="indices"):
        aug.train(x, 0, 0)


@pytest.mark.slow
def test_compiled_augmentation_equals_eager():
    cfg = load_config(None, ["data.crop_padding=2", "data.crop_mode=reflect"])
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    eager = Augment(cfg, rt(0, 1), channels_last=True).train(x, 3, 5)
    compiled = Augment(cfg, rt(0, 1), channels_last=True, compiled=True).train(x, 3, 5)
    assert compiled.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_flip_and_normalise_statistics():
    cfg = load_config(None, ["data.crop_padding=0"])
    x = torch.randint(0, 256, (400, 3, 32, 32), dtype=torch.uint8)
    aug = Augment(cfg, rt(0, 1), channels_last=True)
    out = aug.train(x, 0, 0)
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
