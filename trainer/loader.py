"""Batches: the epoch order, rank shards, augmentation on whole batches, and the test shards.

Two loaders give the same batches (the tests check it):

* ``DeviceLoader`` (default on GPUs): the uint8 data set lives on the device; a step is one
  gather. No host work per step, so the input pipeline never waits on Python or PCIe.
* ``HostLoader``: a DataLoader over DistributedSampler with pinned memory and non-blocking
  copies, for data that should stay in host memory.

Both follow DistributedSampler's order: one permutation per epoch from ``seed + epoch``
(``set_epoch`` every epoch, so the order changes), rank r takes every world-size-th index.
Global batch k is then the same images whatever the world size, which is what lets a job resume
on another number of GPUs. Augmentation (random crop with padding, horizontal flip) runs on the
whole batch on the device, with random numbers drawn for the global batch from
``(seed, epoch, step)``: a resumed run draws the same ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainer.config import Config
from trainer.data import CIFAR_MEAN, CIFAR_STD, Split
from trainer.dist import Runtime


class ShardSampler(DistributedSampler):
    """DistributedSampler that can start mid-epoch, skipping the global batches already trained."""

    def __init__(self, n: int, rt: Runtime, seed: int, per_rank_batch: int):
        super().__init__(range(n), num_replicas=rt.world_size, rank=rt.rank, shuffle=True, seed=seed, drop_last=True)
        self.per_rank_batch = per_rank_batch
        self.start_step = 0

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.start_step * self.per_rank_batch :])

    def __len__(self) -> int:
        return self.num_samples - self.start_step * self.per_rank_batch


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation DistributedSampler(shuffle=True) draws for ``epoch``."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


class Augment:
    """uint8 batch -> normalised float batch, with random crop and flip for training."""

    def __init__(self, cfg: Config, rt: Runtime, channels_last: bool):
        self.pad, self.flip, self.seed = cfg.data.crop_padding, cfg.data.flip, cfg.train.seed
        self.reflect = cfg.data.crop_mode == "reflect"
        self.rt, self.channels_last = rt, channels_last
        self.mean = torch.tensor(CIFAR_MEAN, device=rt.device).view(1, 3, 1, 1) * 255
        self.inv_std = 1 / (torch.tensor(CIFAR_STD, device=rt.device).view(1, 3, 1, 1) * 255)
        self.gen = torch.Generator(device=rt.device)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = (x.float() - self.mean) * self.inv_std
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def train(self, x: torch.Tensor, epoch: int, step: int) -> torch.Tensor:
        if self.pad or self.flip:
            # Draw for the whole global batch and keep this rank's positions (r, r+W, ...), so the
            # numbers do not depend on the world size. Seeding a generator is host-only: no sync.
            self.gen.manual_seed(self.seed * 1_000_003 + epoch * 100_003 + step)
            b, w, r = x.shape[0], self.rt.world_size, self.rt.rank
            shift = torch.randint(0, 2 * self.pad + 1, (b * w, 2), generator=self.gen, device=x.device)[r::w]
            mirror = torch.rand(b * w, generator=self.gen, device=x.device)[r::w] < 0.5
            if self.pad:
                x = random_crop(x, shift, self.pad, self.reflect)
            if self.flip:
                x = torch.where(mirror.view(-1, 1, 1, 1), x.flip(3), x)
        return self.normalize(x)


def random_crop(x: torch.Tensor, shift: torch.Tensor, pad: int, reflect: bool = False) -> torch.Tensor:
    """Crop each image of ``x`` [B,C,H,W] from its padded copy at offsets ``shift`` [B,2] in
    [0, 2*pad], in one gather: the padding is index arithmetic, never materialised."""
    b, c, h, w = x.shape
    rows = shift[:, 0:1] - pad + torch.arange(h, device=x.device)  # source row of each output row
    cols = shift[:, 1:2] - pad + torch.arange(w, device=x.device)
    if reflect:
        rows, cols = _mirror(rows, h), _mirror(cols, w)
        inside = None
    else:
        inside = ((rows >= 0) & (rows < h)).view(b, 1, h, 1) & ((cols >= 0) & (cols < w)).view(b, 1, 1, w)
        rows, cols = rows.clamp(0, h - 1), cols.clamp(0, w - 1)
    chans = torch.arange(c, device=x.device).view(1, c, 1, 1)
    out = x[torch.arange(b, device=x.device).view(b, 1, 1, 1), chans, rows.view(b, 1, h, 1), cols.view(b, 1, 1, w)]
    return out if inside is None else out * inside


def _mirror(i: torch.Tensor, n: int) -> torch.Tensor:
    i = i.abs()
    return torch.where(i >= n, 2 * (n - 1) - i, i)


class DeviceLoader:
    """The whole uint8 training set on ``rt.device``; each step gathers this rank's indices."""

    def __init__(self, split: Split, rt: Runtime, per_rank_batch: int, seed: int):
        self.images = split.images.to(rt.device)
        self.labels = split.labels.to(rt.device)
        self.rt, self.b, self.seed = rt, per_rank_batch, seed
        self.steps_per_epoch = len(split) // (per_rank_batch * rt.world_size)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = epoch_order(len(self.labels), self.seed, epoch)
        w, r = self.rt.world_size, self.rt.rank
        mine = order[: len(order) // w * w][r::w][: self.steps_per_epoch * self.b]
        if self.rt.cuda:
            mine = mine.pin_memory()
        mine = mine.to(self.rt.device, non_blocking=True)  # one small copy per epoch
        for step in range(start_step, self.steps_per_epoch):
            idx = mine[step * self.b : (step + 1) * self.b]
            yield self.images[idx], self.labels[idx]


class HostLoader:
    """DataLoader + DistributedSampler over host memory, copied to the device per step."""

    def __init__(self, split: Split, rt: Runtime, per_rank_batch: int, seed: int, num_workers: int):
        self.rt = rt
        self.sampler = ShardSampler(len(split), rt, seed, per_rank_batch)
        self.loader = DataLoader(
            TensorDataset(split.images, split.labels), batch_size=per_rank_batch, sampler=self.sampler,
            drop_last=True, num_workers=num_workers, pin_memory=rt.cuda, persistent_workers=num_workers > 0,
        )
        self.steps_per_epoch = self.sampler.num_samples // per_rank_batch

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.sampler.set_epoch(epoch)  # a new order every epoch (the article passed a constant here)
        self.sampler.start_step = start_step
        for x, y in self.loader:
            yield x.to(self.rt.device, non_blocking=True), y.to(self.rt.device, non_blocking=True)


def make_train_loader(cfg: Config, rt: Runtime, split: Split, device_resident: bool):
    b = rt.per_rank_batch(cfg.train.batch_size)
    if device_resident:
        return DeviceLoader(split, rt, b, cfg.train.seed)
    return HostLoader(split, rt, b, cfg.train.seed, cfg.data.num_workers)


def eval_shard(n: int, rt: Runtime) -> range:
    """Contiguous test shard of this rank: every test image is counted exactly once in all."""
    per, extra = divmod(n, rt.world_size)
    start = rt.rank * per + min(rt.rank, extra)
    return range(start, start + per + (1 if rt.rank < extra else 0))


def eval_batches(split: Split, rt: Runtime, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's test shard in batches; every rank yields the same number of batches (the last
    ones may be empty) so that collectives inside a sharded model's forward stay in step."""
    shard = eval_shard(len(split), rt)
    longest = -(-len(split) // rt.world_size)
    for k in range(-(-longest // batch)):
        i = min(shard.start + k * batch, shard.stop)
        j = min(i + batch, shard.stop)
        yield split.images[i:j].to(rt.device, non_blocking=True), split.labels[i:j].to(rt.device, non_blocking=True)
