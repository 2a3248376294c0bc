"""The streamed path: batches read from shards step by step, for sets that do not fit in memory.

The order is the in-memory loaders' (trainer/worker/data/loader.py): one permutation of the whole set per
epoch from ``seed + epoch``, rank r takes every world-size-th image, so global batch k holds the
same images at any world size, and a resume at step k (at any world size) reads on from there.
Each image's crop and flip come from uniform numbers drawn for its place in the global batch
from ``(seed, epoch, step)``: the same at any world size and after a resume.

DataLoader workers read a step's JPEG bytes by index (trainer/worker/data/shards.py). With ``decode=cpu`` the
workers decode (libjpeg-turbo through torchvision.io), crop and resize in uint8, and the step
receives uint8 images. With ``decode=gpu`` the workers only read: a batch's JPEGs travel as one
buffer (one shared-memory segment and one pinned copy, not one per image), nvjpeg decodes them in
one call (torchvision.io.decode_jpeg on a list; the A100/H100 hardware decoder for baseline JPEGs),
and one torchvision.ops.roi_align call crops and resizes the whole batch (each output pixel the mean
of the bilinear samples in its cell: an antialiased resize, within a level of F.interpolate's on
average). A thread does this two batches ahead, on a side stream (DecodeAhead). The one buffer and
the batched crop are what made the GPU feed fast (BENCHMARKS.md, "Your own images: ResNet-50 at
224 px from shards"). Host memory is bounded by the workers' prefetched batches (2 per worker),
whatever the set's size.

torchvision 0.29 marks its image decoders deprecated in favour of TorchCodec's; they still work
(and the GPU hosts' torchvision 0.26 has no such note). Moving to TorchCodec is a change of this
module alone.

A JPEG that does not decode (a damaged shard) is skipped: a copy of the batch's first good image
takes its place (the batch keeps its shape; compiled steps and CUDA graphs need it), a line names
the shard and key, and past ``data.max_bad_images`` on one rank the run stops with exit 2.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from trainer.config import Config, ConfigError
from trainer.contract import say
from trainer.worker.data import store_size
from trainer.worker.data.loader import crop_boxes, quiet_worker, rank_order
from trainer.worker.data.shards import ShardSet
from trainer.worker.runtime import Runtime


def center_box(h: int, w: int, size: int) -> tuple[int, int, int, int]:
    """The test crop: torchvision's Resize(size * 8/7) + CenterCrop(size) as one box of the image
    (the whole shorter side for small images, whose stored size is their size: data.store_size)."""
    side = min(h, w) * size / store_size(size)
    ch = cw = max(1, round(side))
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def step_uniforms(seed: int, epoch: int, step: int, global_batch: int) -> torch.Tensor:
    """[global_batch, 5] uniforms of one global step (crop box and flip coin per place)."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 1_000_033 + step) % (2**63))
    return torch.rand(global_batch, 5, generator=g)


def decode_cpu(raw: torch.Tensor) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(raw, mode=ImageReadMode.RGB)


def crop_resize(img: torch.Tensor, box, size: int, flip: bool = False) -> torch.Tensor:
    """uint8 [3, H, W] -> uint8 [3, size, size] on the CPU: the box, resized (bilinear, antialiased),
    mirrored; in uint8 and channels-last (torch's vectorised path: 7x the float one per core,
    measured)."""
    top, left, ch, cw = box
    x = img[:, top : top + ch, left : left + cw].unsqueeze(0)
    x = x.contiguous(memory_format=torch.channels_last)
    x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
    return x.flip(2) if flip else x


def boxes(images: list, size: int, u: torch.Tensor | None, flip: bool) -> tuple[list, list[bool]]:
    """Every image's crop box (random-resized from ``u``, else the test centre crop) and mirror
    flag, for the whole batch at once (a box per image in small tensor ops cost more than its
    decode). A missing image (one that did not decode) gets a box it never uses."""
    sizes = [(im.shape[1], im.shape[2]) if im is not None else (1, 1) for im in images]
    if u is None:
        return [center_box(h, w, size) for h, w in sizes], [False] * len(images)
    h, w = torch.tensor(sizes).unbind(1)
    return crop_boxes(u, h, w).tolist(), ((u[:, 4] < 0.5) & flip).tolist()


class StepBatches(Dataset):
    """Item (epoch, step): this rank's images of that global step. GPU decode: the raw JPEG bytes;
    CPU decode: decoded, cropped, resized and mirrored uint8 images. Worker processes run it."""

    def __init__(
        self, shards: ShardSet, rank: int, world: int, per_rank: int, seed: int, size: int, flip: bool, on_cpu: bool
    ):
        self.shards, self.rank, self.world, self.b, self.seed = shards, rank, world, per_rank, seed
        self.size, self.flip, self.on_cpu = size, flip, on_cpu
        self._order: tuple[int, torch.Tensor] | None = None

    def mine(self, epoch: int) -> torch.Tensor:
        """This rank's indices of ``epoch`` (drawn once per epoch in each worker)."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, rank_order(len(self.shards), self.seed, epoch, self.rank, self.world))
        return self._order[1]

    def __getitem__(self, item: tuple[int, int]):
        epoch, step = item
        idx = self.mine(epoch)[step * self.b : (step + 1) * self.b]
        u = step_uniforms(self.seed, epoch, step, self.b * self.world)[self.rank :: self.world]
        raws, labels, where = read(self.shards, idx.tolist())
        if not self.on_cpu:
            return one_buffer(raws), labels, idx, u, where
        x, labels, bad = decode_crop_cpu(raws, labels, where, self.size, u, self.flip)
        return x, labels, idx, bad


def decode_each(raws: list[torch.Tensor], decode) -> tuple[list, list[int]]:
    """Each JPEG decoded alone: the images (None where one does not decode) and those places."""
    images, bad = [], []
    for j, raw in enumerate(raws):
        try:
            images.append(decode(raw))
        except RuntimeError:
            images.append(None)
            bad.append(j)
    return images, bad


def fill_bad(images: list, at: list, mirror: list, labels: torch.Tensor, bad: list[int], where: list[str]) -> list[str]:
    """Before the crops: a place whose image did not decode takes the first good one (image, box,
    mirror flag and label: a copy of its crop), in place; the shard and key of each such place,
    for the count and the line. The batch keeps its shape (compiled steps and CUDA graphs need it)."""
    good = next((j for j in range(len(images)) if images[j] is not None), None)
    if good is None:
        shard = where[0].split(":")[0]
        raise ConfigError(
            f"no image of a batch decodes (first: {where[0]}): {shard} is damaged or not a shard; write the shards "
            f"again "
            f"with trainer data --shards, or copy {shard} again"
        )
    for j in bad:
        images[j], at[j], mirror[j], labels[j] = images[good], at[good], mirror[good], labels[good]
    return [where[j] for j in bad]


def one_buffer(raws: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """A batch's JPEGs as one uint8 tensor and their lengths: one shared-memory segment from the
    worker and one pinned copy, where a tensor each costs a file descriptor and a pinning each."""
    return (torch.cat(raws) if raws else torch.empty(0, dtype=torch.uint8)), [r.numel() for r in raws]


def gpu_decode(cfg: Config, rt: Runtime) -> bool:
    """Streamed JPEGs decoded on the GPU (data.decode=gpu; auto: by the CPU workers, measured faster)."""
    return rt.cuda and cfg.data.decode == "gpu"


def workers(cfg: Config, gpu_decode: bool) -> int:
    if cfg.data.stream_workers:
        return cfg.data.stream_workers
    if gpu_decode:
        return 4
    import os

    return max(1, min(16, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


class Streamed:
    """A split that stays in its shards (the run's train_split or test_split on the streamed path)."""

    images = None

    def __init__(self, root: Path, split: str):
        self.shards = ShardSet(root, split)
        self.classes = self.shards.classes

    def __len__(self) -> int:
        return len(self.shards)

    def sample(self, n: int, size: int) -> torch.Tensor:
        """uint8 [n, 3, size, size]: centre crops of n images spread over the set (airnet's
        whitening is computed from them, as from the first 5,000 of a set in memory)."""
        ids = range(0, len(self.shards), max(1, len(self.shards) // n))[:n]
        return decode_crop_cpu(*read(self.shards, ids), size, None, False)[0]


class StreamLoader:
    """Training batches from shards: (normalised float images, labels, data-set indices) per step,
    as DeviceLoader and HostLoader give them."""

    def __init__(self, split: Streamed, cfg: Config, rt: Runtime, per_rank_batch: int, augment, gpu_decode: bool):
        self.rt, self.b, self.augment, self.gpu = rt, per_rank_batch, augment, gpu_decode
        self.size, self.max_bad, self.bad = cfg.data.image_size, cfg.data.max_bad_images, 0
        self.steps_per_epoch = len(split) // (per_rank_batch * rt.world_size)
        self.data = StepBatches(
            split.shards,
            rt.rank,
            rt.world_size,
            per_rank_batch,
            cfg.train.seed,
            self.size,
            cfg.data.flip,
            not gpu_decode,
        )
        n = workers(cfg, gpu_decode)
        self.loader_args = {
            "num_workers": n,
            "pin_memory": rt.cuda,
            "prefetch_factor": 2 if n else None,
            "persistent_workers": n > 0,
            "batch_size": None,
            "collate_fn": _as_is,
            "worker_init_fn": quiet_worker,
        }
        self._loader: DataLoader | None = None
        self._sampler = _Steps()

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        self._sampler.items = [(epoch, k) for k in range(start_step, self.steps_per_epoch)]
        if self._loader is None:
            self._loader = DataLoader(self.data, sampler=self._sampler, **self.loader_args)
        if not self.gpu:
            for item in self._loader:
                yield self.finish(item)
            return
        ahead = DecodeAhead(iter(self._loader), self.prepare, self.rt.device)
        try:
            for x, labels, idx, bad in ahead:
                self.count_bad(bad)
                yield x, labels, idx
        finally:
            ahead.close()

    def prepare(self, item) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
        """A worker's batch on the device, decoded (GPU path), mirrored and normalised, and the
        names of the images that did not decode."""
        dev = self.rt.device
        if self.gpu:
            raws, labels, idx, u, where = item
            x, labels, bad = decode_on_gpu(raws, labels, where, self.size, dev, u, self.augment.flip)
        else:
            x, labels, idx, bad = item
            x = x.to(dev, non_blocking=True)
        return self.augment.normalize(x), labels.to(dev, non_blocking=True), idx.to(dev, non_blocking=True), bad

    def finish(self, item) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, labels, idx, bad = self.prepare(item)
        self.count_bad(bad)
        return x, labels, idx

    def count_bad(self, bad: list[str]) -> None:
        if not bad:
            return
        self.bad += len(bad)
        say(
            f"rank {self.rt.rank}: skipped {len(bad)} image(s) that do not decode ({', '.join(bad[:2])}); {self.bad} "
            f"so far, "
            f"the run stops past data.max_bad_images={self.max_bad}"
        )
        if self.bad > self.max_bad:
            shard = bad[0].split(":")[0]
            raise ConfigError(
                f"{self.bad} images did not decode on rank {self.rt.rank} (past data.max_bad_images={self.max_bad}; "
                f"last in "
                f"{shard}): the shards are damaged; write them again with trainer data --shards, or copy {shard} again"
            )

    def first_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Epoch 0's first batch (warm-up): the same images and crops the first step reads."""
        x, y, _ = self.finish(self.data[(0, 0)])
        return x, y


def decode_on_gpu(
    raws: tuple[torch.Tensor, list[int]],
    labels: torch.Tensor,
    where: list[str],
    size: int,
    device: torch.device,
    u: torch.Tensor | None = None,
    flip: bool = False,
):
    """One nvjpeg call for the batch (``raws``: :func:`one_buffer`'s), then every image's crop
    (random-resized from ``u``, or the test centre crop without it) resized to ``size`` by one
    roi_align: float [n, 3, size, size]."""
    import os

    if os.environ.get("TRAINER_GPU_DECODER", "nvjpeg") != "nvjpeg":  # the bench's switch (nvimgcodec, roi)
        return decode_nvimgcodec(raws, labels, where, size, device, u, flip)
    from torchvision.io import ImageReadMode, decode_jpeg

    views = list(torch.split(raws[0], raws[1]))
    try:
        images, bad = decode_jpeg(views, mode=ImageReadMode.RGB, device=device), []
    except RuntimeError:  # one bad JPEG fails the batched call: decode one by one to find it
        images, bad = decode_each(views, lambda raw: decode_jpeg(raw, mode=ImageReadMode.RGB, device=device))
    at, mirror = boxes(images, size, u, flip)
    lost = fill_bad(images, at, mirror, labels, bad, where)
    return crop_batch(images, at, mirror, size), labels, lost


_DECODERS: dict = {}


def nvimgcodec_decoder(device: torch.device):
    """nvImageCodec's decoder for ``device``, made once per process (it holds the codec's threads and
    the hardware decoder's state)."""
    from nvidia import nvimgcodec

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DECODERS:
        _DECODERS[index] = nvimgcodec.Decoder(device_id=index)
    return _DECODERS[index]


def decode_nvimgcodec(raws, labels, where, size, device, u=None, flip=False):
    """nvImageCodec's batched decode (the hardware JPEG engine where the GPU has one, else CUDA),
    then :func:`crop_batch`. TRAINER_GPU_DECODER=roi decodes only each image's crop box (read
    from the JPEG's header before the decode)."""
    import os

    from nvidia import nvimgcodec

    buf, lengths = raws[0].numpy(), raws[1]
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    streams = [nvimgcodec.CodeStream(buf[o : o + n]) for o, n in zip(starts, lengths, strict=True)]
    stream = torch.cuda.current_stream(device).cuda_stream
    roi = os.environ.get("TRAINER_GPU_DECODER") == "roi"
    if roi:
        heads = [torch.empty(0, cs.height, cs.width) for cs in streams]
        at, mirror = boxes(heads, size, u, flip)
        streams = [
            cs.get_sub_code_stream(region=nvimgcodec.Region(t, lft, t + h, lft + w))
            for cs, (t, lft, h, w) in zip(streams, at, strict=True)
        ]
    out = nvimgcodec_decoder(device).decode(streams, cuda_stream=stream)
    images = [torch.from_dlpack(im).permute(2, 0, 1) if im is not None else None for im in out]
    bad = [j for j, im in enumerate(images) if im is None]
    if roi:
        at = [(0, 0, im.shape[1], im.shape[2]) if im is not None else (0, 0, 1, 1) for im in images]
    else:
        at, mirror = boxes(images, size, u, flip)
    lost = fill_bad(images, at, mirror, labels, bad, where)
    return crop_batch(images, at, mirror, size), labels, lost


def crop_batch(
    images: list[torch.Tensor], at: list, mirror: list[bool], size: int, chunk_values: int = 1 << 28
) -> torch.Tensor:
    """uint8 [3, H_i, W_i] images (of any sizes), their boxes (top, left, height, width) and mirror
    flags -> float [n, 3, size, size], 0-255: one roi_align per chunk of images padded to the largest
    (chunks of at most ``chunk_values`` floats, 1 GiB, whatever the images' size)."""
    from torchvision.ops import roi_align

    dev = images[0].device
    h, w = max(im.shape[1] for im in images), max(im.shape[2] for im in images)
    per = max(1, chunk_values // (3 * h * w))
    b = torch.tensor(at, dtype=torch.float, device=dev)
    rois = torch.stack(
        [
            torch.arange(len(images), device=dev, dtype=torch.float),
            b[:, 1],
            b[:, 0],
            b[:, 1] + b[:, 3],
            b[:, 0] + b[:, 2],
        ],
        1,
    )
    out = []
    for k in range(0, len(images), per):
        part = images[k : k + per]
        if all(im.shape == part[0].shape for im in part):
            x = torch.stack(part)
        else:
            x = torch.zeros(len(part), 3, h, w, dtype=torch.uint8, device=dev)
            for j, im in enumerate(part):
                x[j, :, : im.shape[1], : im.shape[2]] = im
        r = rois[k : k + per].clone()
        r[:, 0] -= k
        # sampling_ratio=-1: ceil(box / size) bilinear samples per output pixel and axis, averaged
        out.append(roi_align(x.float(), r, size, 1.0, -1, True))
    x = torch.cat(out) if len(out) > 1 else out[0]
    m = torch.tensor(mirror, device=dev)
    return torch.where(m[:, None, None, None], x.flip(3), x)


class DecodeAhead:
    """The GPU path's batches decoded ``depth`` steps ahead by a thread, on a side CUDA stream, while
    the training thread launches the step. nvjpeg holds its caller for the batch's decode (11 ms for
    256 photo-sized JPEGs on an H100, the GIL released): on the training thread the GPU then waited
    for a quarter of each ResNet-50 step. Order, crops and errors are the same as without it: one
    thread takes the DataLoader's batches in order, and an error reaches the training thread at the
    batch where it happened. On the CPU (tests) the same thread runs without streams."""

    def __init__(self, items: Iterator, prepare, device: torch.device, depth: int = 2):
        self._q, self._stop = queue.Queue(depth), threading.Event()
        self._cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self._cuda else None
        self._thread = threading.Thread(target=self._run, args=(items, prepare), name="gpu-decode-ahead", daemon=True)
        self._thread.start()

    def _run(self, items: Iterator, prepare) -> None:
        try:
            with torch.cuda.stream(self._side) if self._cuda else contextlib.nullcontext():
                for item in items:
                    out = prepare(item)
                    done = torch.cuda.Event() if self._cuda else None
                    if done is not None:
                        # wait until the side stream has read this batch: torchvision's nvjpeg writes the
                        # next batch's images on a stream of its own, into memory this batch's crop may
                        # still be reading (the allocator reuses it in the side stream's order alone)
                        done.record(self._side)
                        done.synchronize()
                    if not self._put((out, done)):
                        return
            self._put(None)
        except BaseException as e:  # noqa: BLE001 - raised again on the training thread
            self._put(e)

    def _put(self, got) -> bool:
        """Queue ``got``, unless the consumer has gone (closed): then False."""
        while not self._stop.is_set():
            try:
                self._q.put(got, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        main = torch.cuda.current_stream() if self._cuda else None
        while (got := self._q.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            out, done = got
            if (
                main is not None
            ):  # the step's stream waits for the decode; the memory is not reused before the step is done
                main.wait_event(done)
                for t in out:
                    if isinstance(t, torch.Tensor):
                        t.record_stream(main)
            yield out

    def close(self) -> None:
        """Stop reading ahead and wait for the thread (it ends after the batch it is reading), so
        that the next epoch's iterator is the DataLoader's only one."""
        self._stop.set()
        self._thread.join()


class _Steps:
    """The sampler of (epoch, step) items: set before each epoch; persistent workers keep reading."""

    def __init__(self):
        self.items: list[tuple[int, int]] = []

    def __iter__(self):
        return iter(list(self.items))

    def __len__(self) -> int:
        return len(self.items)


def _as_is(item):
    return item


def eval_batches(split: Streamed, cfg: Config, rt: Runtime, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's contiguous share of the test shards in batches, centre-cropped at
    data.image_size (uint8 from CPU workers, float from the GPU's decoder); every rank yields the
    same number of batches (the last ones may be empty), as trainer/worker/data/loader.py's eval_batches."""
    from trainer.worker.data.loader import eval_shard

    shards, on_gpu = split.shards, gpu_decode(cfg, rt)
    mine, size = eval_shard(len(shards), rt), cfg.data.image_size
    longest = math.ceil(len(shards) / rt.world_size)
    total = math.ceil(longest / batch)
    data = _EvalBatches(shards, mine, batch, size, not on_gpu)
    loader = DataLoader(
        data,
        batch_size=None,
        num_workers=min(len(data), workers(cfg, on_gpu)),
        collate_fn=_as_is,
        pin_memory=rt.cuda,
        worker_init_fn=quiet_worker,
    )
    for item in loader:
        if on_gpu:
            x, labels, _ = decode_on_gpu(item[0], item[1], item[2], size, rt.device)
        else:
            x, labels = item[0].to(rt.device, non_blocking=True), item[1]
        yield x, labels.to(rt.device, non_blocking=True)
    for _ in range(total - len(data)):
        yield (
            torch.empty(0, 3, size, size, dtype=torch.uint8, device=rt.device),
            torch.empty(0, dtype=torch.long, device=rt.device),
        )


class _EvalBatches(Dataset):
    def __init__(self, shards: ShardSet, mine: range, batch: int, size: int, on_cpu: bool):
        self.shards, self.mine, self.batch, self.size, self.on_cpu = shards, mine, batch, size, on_cpu

    def __len__(self) -> int:
        return -(-len(self.mine) // self.batch)

    def __getitem__(self, k: int):
        ids = self.mine[k * self.batch : (k + 1) * self.batch]
        raws, labels, where = read(self.shards, ids)
        if not self.on_cpu:
            return one_buffer(raws), labels, where
        return decode_crop_cpu(raws, labels, where, self.size, None, False)[:2]


def read(shards: ShardSet, ids) -> tuple[list[torch.Tensor], torch.Tensor, list[str]]:
    """The JPEG bytes (as uint8 tensors), labels and names of samples ``ids``."""
    raws, labels, where = [], [], []
    for i in ids:
        raw, label, name = shards[int(i)]
        raws.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        labels.append(label)
        where.append(name)
    return raws, torch.tensor(labels, dtype=torch.long), where


def decode_crop_cpu(raws, labels, where, size: int, u: torch.Tensor | None, flip: bool):
    """The CPU path of :func:`decode_on_gpu`, in a worker: uint8 [n, 3, size, size]."""
    images, bad = decode_each(raws, decode_cpu)
    at, mirror = boxes(images, size, u, flip)
    lost = fill_bad(images, at, mirror, labels, bad, where)
    return torch.stack([crop_resize(img, at[j], size, mirror[j]) for j, img in enumerate(images)]), labels, lost
