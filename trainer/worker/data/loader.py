"""Batches: the epoch order, rank shards, augmentation on the device, and the test shards.

Two loaders give the same batches (the tests check it):

* ``DeviceLoader`` (default on GPUs): the uint8 data set lives on the device; each epoch is
  gathered and augmented at once (in chunks for big sets), and a step only takes a slice. No
  kernels and no host work per step, so the input pipeline never waits on Python or PCIe.
* ``HostLoader``: a DataLoader over DistributedSampler with pinned memory and non-blocking
  copies, for data that should stay in host memory; it augments each batch on the device.

Both follow DistributedSampler's order: one permutation per epoch from ``seed + epoch``
(``set_epoch`` every epoch, so the order changes), rank r takes every world-size-th index.
Global batch k is then the same images whatever the world size, which is what lets a job resume
on another number of GPUs. Augmentation (random crop with padding, horizontal flip) draws its
random numbers for every global position of the epoch from ``(seed, epoch)``: a resumed run, or
one on another number of GPUs, draws the same ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainer.config import Config
from trainer.worker.data import Split, norm_stats, small
from trainer.worker.runtime import Runtime


def quiet_worker(_: int) -> None:
    """A DataLoader worker leaves stop signals to its process: torchrun's re-form and Slurm send
    SIGTERM to every process of the worker's group, and a worker killed by it made the training
    process fail ("DataLoader worker ... is killed by signal: Terminated") instead of saving and
    stopping. A worker ends with its DataLoader, or when its parent is gone, or at a SIGTERM from
    its parent alone: multiprocessing's exit hook sends one to each worker still up (an error's
    traceback holding their iterator) and waits for it, which would otherwise be forever."""
    import os
    import signal
    import threading

    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by the thread below, not by Python's handler

    def parents_sigterm() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=parents_sigterm, name="parent-sigterm", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


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


def rank_order(n: int, seed: int, epoch: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s indices of ``epoch``, as DistributedSampler deals them: every world-size-th
    image of :func:`epoch_order` (the tail that does not fill a round dropped). Global batch k is
    then the same images at any world size."""
    order = epoch_order(n, seed, epoch)
    return order[: n // world * world][rank::world]


class Augment:
    """uint8 images -> normalised float images, with random crop and flip for training: CIFAR's
    pad-and-crop for small images, a random-resized crop of the stored image (one batched
    affine resample: crop, resize and mirror in one kernel) for larger ones.

    The random numbers of a whole epoch are drawn at once from ``(seed, epoch)`` for every global
    position (step k, place j in the global batch), and each rank keeps its own positions, so an
    image's crop and flip depend on neither the world size nor on how many steps are augmented
    in one call: the device loader augments a whole epoch in one go (a dozen kernels per epoch
    instead of per step), the host loader one step at a time, and both give the same batches.
    """

    def __init__(
        self,
        cfg: Config,
        rt: Runtime,
        channels_last: bool,
        per_rank_batch: int = 0,
        steps_per_epoch: int = 0,
        norm: tuple | None = None,
    ):
        self.pad, self.flip, self.seed = cfg.data.crop_padding, cfg.data.flip, cfg.train.seed
        self.reflect = cfg.data.crop_mode == "reflect"
        self.alternate = cfg.data.flip_mode == "alternate"
        self.rt, self.channels_last = rt, channels_last
        self.b, self.steps = per_rank_batch, steps_per_epoch
        self.size = cfg.data.image_size or 32
        self.resized = not small(self.size)
        mean, std = norm or norm_stats(self.size)  # a pretrained start's own (trainer/worker/pretrained.py)
        self.mean = torch.tensor(mean, device=rt.device).view(1, 3, 1, 1) * 255
        self.inv_std = 1 / (torch.tensor(std, device=rt.device).view(1, 3, 1, 1) * 255)
        self._drawn: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 -> float, in the layout the model wants: the layout change happens on the uint8
        copy (a quarter of the bytes) and the arithmetic in place (one float copy, not three)."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        # the default float type (float32; float64 in the equivalence tests); .to keeps the layout
        return x.to(torch.get_default_dtype()).sub_(self.mean).mul_(self.inv_std)

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        """Test images: the centre data.image_size of the stored ones (torchvision's resize to 8/7,
        centre crop), normalised."""
        if x.shape[-1] > self.size:
            o = (x.shape[-1] - self.size) // 2
            x = x[:, :, o : o + self.size, o : o + self.size]
        return self.normalize(x)

    def draws(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's crop offsets [steps, b, 2] (uniforms [steps, b, 4] of the resized crop) and
        coin flips [steps, b] of ``epoch``."""
        if self._drawn is None or self._drawn[0] != epoch:
            gen = torch.Generator(device=self.rt.device).manual_seed(self.seed * 1_000_003 + epoch)
            w, r, shape = self.rt.world_size, self.rt.rank, (self.steps, self.b * self.rt.world_size)
            if self.resized:
                shift = torch.rand((*shape, 4), generator=gen, device=self.rt.device)[:, r::w]
            else:
                shift = torch.randint(0, 2 * self.pad + 1, (*shape, 2), generator=gen, device=self.rt.device)[:, r::w]
            coin = torch.rand(shape, generator=gen, device=self.rt.device)[:, r::w] < 0.5
            self._drawn = (epoch, shift, coin)
        return self._drawn[1], self._drawn[2]

    def train(self, x: torch.Tensor, epoch: int, step: int, idx: torch.Tensor) -> torch.Tensor:
        """Augment ``x``: this rank's images of steps ``step``, ``step + 1``, ... (a whole number of
        per-rank batches); ``idx`` are their indices in the data set (for flip_mode=alternate)."""
        if not (self.pad or self.flip or self.resized):
            return self.normalize(x)
        n = len(x) // self.b
        if n * self.b != len(x) or step + n > self.steps:
            raise ValueError(
                f"augment {len(x)} images from step {step}: expected whole batches of {self.b} within {self.steps} "
                f"steps"
            )
        shift, coin = (t[step : step + n].flatten(0, 1) for t in self.draws(epoch))
        mirror = None
        if self.flip:
            mirror = alternate_mirror(idx, self.seed, epoch) if self.alternate else coin
        if self.resized:
            return self.normalize(resized_crop(x, shift, self.size, mirror))
        return self.normalize(random_crop(x, shift, self.pad, self.reflect, mirror))


def alternate_mirror(idx: torch.Tensor, seed: int, epoch: int) -> torch.Tensor:
    """Alternating flip (airbench): a fixed random half of the images is mirrored in even epochs and
    the other half in odd ones, so every image is seen both ways, in turn, instead of the same way
    several epochs running by chance. The bit per image is a multiplicative hash of its index."""
    bit = (((idx + 7919 * seed) * 2654435761) >> 31) & 1
    return (bit ^ (epoch & 1)).bool()


def random_crop(
    x: torch.Tensor, shift: torch.Tensor, pad: int, reflect: bool = False, mirror: torch.Tensor | None = None
) -> torch.Tensor:
    """Crop each image of ``x`` [B,C,H,W] from its padded copy at offsets ``shift`` [B,2] in
    [0, 2*pad], and mirror the crops where ``mirror`` [B] is set: two gathers (rows, then
    columns) whose indices are broadcast views, so the padding, the flip and the indices are
    never materialised at the images' size (one [B,C,H,W] index tensor per dimension, which
    advanced indexing builds, is 8x the uint8 images: 1.2 GB each for CIFAR-10)."""
    b, c, h, w = x.shape
    out_cols = torch.arange(w, device=x.device).expand(b, w)
    if mirror is not None:
        out_cols = torch.where(mirror.view(b, 1), w - 1 - out_cols, out_cols)  # column j reads w-1-j
    rows = shift[:, 0:1] - pad + torch.arange(h, device=x.device)  # source row of each output row
    cols = shift[:, 1:2] - pad + out_cols
    if reflect:
        rows, cols = _mirror(rows, h), _mirror(cols, w)
        inside = None
    else:
        inside = ((rows >= 0) & (rows < h)).view(b, 1, h, 1) & ((cols >= 0) & (cols < w)).view(b, 1, 1, w)
        rows, cols = rows.clamp(0, h - 1), cols.clamp(0, w - 1)
    out = x.gather(2, rows.view(b, 1, h, 1).expand(b, c, h, w)).gather(3, cols.view(b, 1, 1, w).expand(b, c, h, w))
    return out if inside is None else out * inside


SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)


def crop_boxes(u: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Random-resized-crop boxes [n, 4] (top, left, height, width) from uniforms ``u`` [n, >=4] and
    the images' sizes: torchvision's area (8-100 %) and aspect ratio (3/4-4/3, log-uniform) without
    its rejection loop (a box that overflows is clipped to the image), so a box depends on its four
    numbers and the image alone."""
    h, w = h.double(), w.double()
    area = h * w * (SCALE[0] + (SCALE[1] - SCALE[0]) * u[:, 0].double())
    ratio = torch.exp(math.log(RATIO[0]) + (math.log(RATIO[1]) - math.log(RATIO[0])) * u[:, 1].double())
    cw = torch.sqrt(area * ratio).round().clamp(1, None).minimum(w)
    ch = torch.sqrt(area / ratio).round().clamp(1, None).minimum(h)
    top = ((h - ch) * u[:, 2].double()).floor()
    left = ((w - cw) * u[:, 3].double()).floor()
    return torch.stack([top, left, ch, cw], 1).long()


def resized_crop(x: torch.Tensor, u: torch.Tensor, size: int, mirror: torch.Tensor | None = None) -> torch.Tensor:
    """Random-resized crops of the square uint8 images ``x`` [B,C,S,S] at ``size``: each image's box
    from its uniforms ``u`` [B,4] (:func:`crop_boxes`, as the streamed path's), resampled
    bilinearly and mirrored by one affine grid for the whole batch. Float out, 0-255."""
    b, s = x.shape[0], x.shape[-1]
    side = torch.full((b,), s, device=x.device)
    top, left, ch, cw = crop_boxes(u, side, side).to(torch.get_default_dtype()).unbind(1)
    sign = 1 - 2 * mirror.to(cw.dtype) if mirror is not None else 1  # a negative x scale mirrors
    theta = torch.zeros(b, 2, 3, device=x.device, dtype=cw.dtype)
    theta[:, 0, 0], theta[:, 0, 2] = sign * cw / s, (2 * left + cw) / s - 1
    theta[:, 1, 1], theta[:, 1, 2] = ch / s, (2 * top + ch) / s - 1
    grid = torch.nn.functional.affine_grid(theta, [b, x.shape[1], size, size], align_corners=False)
    return torch.nn.functional.grid_sample(
        x.to(cw.dtype), grid, mode="bilinear", padding_mode="border", align_corners=False
    )


def _mirror(i: torch.Tensor, n: int) -> torch.Tensor:
    i = i.abs()
    return torch.where(i >= n, 2 * (n - 1) - i, i)


class DeviceLoader:
    """The whole uint8 training set on ``rt.device``. Each epoch gathers this rank's images and
    augments them in chunks of many steps (the whole epoch for CIFAR-10), so a step only slices:
    no kernels and no host work per step for the input."""

    def __init__(
        self,
        split: Split,
        rt: Runtime,
        per_rank_batch: int,
        seed: int,
        augment: Augment | None = None,
        chunk_bytes: int = 1 << 30,
    ):
        self.images = split.images.to(rt.device)
        self.labels = split.labels.to(rt.device)
        self.rt, self.b, self.seed, self.augment = rt, per_rank_batch, seed, augment
        self.steps_per_epoch = len(split) // (per_rank_batch * rt.world_size)
        float_batch = per_rank_batch * split.images[0].numel() * 4
        self.chunk_steps = max(1, min(self.steps_per_epoch, chunk_bytes // float_batch))  # bounds the float copy
        # The next epoch's order is drawn on a helper thread while this epoch trains: the host
        # randperm and pinning took 10-20 ms, which the GPU spent idle when they ran on the
        # training thread at an epoch's start (a profile showed it: 2-3% of ResNet-18's step time,
        # 7-11% of the speed recipe's). The helper makes no CUDA calls (a CUDA graph may be
        # recording meanwhile): it fills one of two pinned buffers, and the training thread copies
        # it to the device (one non-blocking copy). PyTorch ops release the GIL, so both threads run.
        n = self.steps_per_epoch * per_rank_batch
        self._pinned = [torch.empty(n, dtype=torch.int64, pin_memory=rt.cuda) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # the last copy out of each buffer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epoch-order")
        self._ahead: tuple[int, Future] | None = None  # (epoch, its order being drawn)

    def order_into(self, epoch: int, out: torch.Tensor) -> torch.Tensor:
        """This rank's indices of ``epoch`` written into the host tensor ``out`` (CPU work only)."""
        return out.copy_(rank_order(len(self.labels), self.seed, epoch, self.rt.rank, self.rt.world_size)[: len(out)])

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's indices of ``epoch`` on the device, from the helper thread when it drew
        them ahead. Then the next epoch's are drawn, into the other buffer."""
        ahead, self._ahead = self._ahead, None
        drawn = ahead[1].result() if ahead else None  # waited for even when unused: never two writers of a buffer
        slot = epoch % 2
        if ahead and ahead[0] == epoch:
            host = drawn
        else:  # the first epoch of a run, or an out-of-turn one
            self._reusable(slot)
            host = self.order_into(epoch, self._pinned[slot])
        if self.rt.cuda:
            mine = host.to(self.rt.device, non_blocking=True)
            self._copied[slot] = torch.cuda.Event()
            self._copied[slot].record()
        else:
            mine = host.clone()
        self._reusable(1 - slot)
        self._ahead = (epoch + 1, self._pool.submit(self.order_into, epoch + 1, self._pinned[1 - slot]))
        return mine

    def _reusable(self, slot: int) -> None:
        """Wait until the last copy out of buffer ``slot`` has run (it ran an epoch ago: no real wait)."""
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()

    def first_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A training batch for the warm-up: the first images, augmented with epoch 0's numbers."""
        return first_batch(self.images, self.labels, self.b, self.augment, self.rt)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(images, labels, data-set indices) of each step; images augmented and normalised when
        the loader has an Augment, else uint8 as stored."""
        mine = self.indices(epoch)
        b = self.b
        for first in range(start_step, self.steps_per_epoch, self.chunk_steps):
            last = min(first + self.chunk_steps, self.steps_per_epoch)
            idx = mine[first * b : last * b]
            x = self.images[idx]
            if self.augment is not None:
                x = self.augment.train(x, epoch, first, idx)
            y = self.labels[idx]
            for k in range(last - first):
                yield x[k * b : (k + 1) * b], y[k * b : (k + 1) * b], idx[k * b : (k + 1) * b]


class HostLoader:
    """DataLoader + DistributedSampler over host memory, copied to the device per step."""

    def __init__(
        self,
        split: Split,
        rt: Runtime,
        per_rank_batch: int,
        seed: int,
        num_workers: int,
        augment: Augment | None = None,
    ):
        self.rt, self.augment = rt, augment
        self.sampler = ShardSampler(len(split), rt, seed, per_rank_batch)
        self.loader = DataLoader(
            TensorDataset(split.images, split.labels, torch.arange(len(split))),
            batch_size=per_rank_batch,
            sampler=self.sampler,
            drop_last=True,
            num_workers=num_workers,
            pin_memory=rt.cuda,
            persistent_workers=num_workers > 0,
            worker_init_fn=quiet_worker,
        )
        self.steps_per_epoch = self.sampler.num_samples // per_rank_batch
        self.split, self.b = split, per_rank_batch

    def first_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return first_batch(self.split.images, self.split.labels, self.b, self.augment, self.rt)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(images, labels, data-set indices) of each step, as DeviceLoader gives them."""
        self.sampler.set_epoch(epoch)  # a new order every epoch (the article passed a constant here)
        self.sampler.start_step = start_step
        for step, batch in enumerate(self.loader, start=start_step):
            x, y, idx = (t.to(self.rt.device, non_blocking=True) for t in batch)
            if self.augment is not None:
                x = self.augment.train(x, epoch, step, idx)
            yield x, y, idx


def first_batch(
    images: torch.Tensor, labels: torch.Tensor, b: int, augment: Augment, rt: Runtime
) -> tuple[torch.Tensor, torch.Tensor]:
    x = augment.train(images[:b].to(rt.device), 0, 0, torch.arange(b, device=rt.device))
    return x, labels[:b].to(rt.device)


def make_train_loader(cfg: Config, rt: Runtime, split: Split, device_resident: bool, augment: Augment):
    b = rt.per_rank_batch(cfg.train.batch_size)
    if device_resident:
        return DeviceLoader(split, rt, b, cfg.train.seed, augment)
    return HostLoader(split, rt, b, cfg.train.seed, cfg.data.num_workers, augment)


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
