"""Data sets as uint8 tensors: CIFAR-10, image folders (or their .tar.gz), shards and a synthetic set.

Each data set is decoded once into a uint8 cache ([N, 3, S, S] images, int64 labels) so that
later runs, and the other processes of this one, read a single file. One process per machine does
the download or decode while the others wait on a file lock: no concurrent-download race, and no
process group is needed for it. trainer/worker/data/loader.py turns these tensors into batches. S is the
stored size (:func:`store_size`): the image size for small images, 8/7 of it for larger ones
(resize the shorter side, centre crop), so that training crops and test centre crops come from it.
A set too large for memory is streamed from shards instead (trainer/worker/data/shards.py,
trainer/worker/data/stream.py);
:func:`plan` decides which, and says why.

torch is imported inside the functions that need it: ``trainer launch`` asks :func:`ready` before
it starts torchrun, and a warm start should not pay torch's import (seconds) in the launcher too.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config import Config, ConfigError
from trainer.contract import one_line, say, warn
from trainer.files import flock, replacing
from trainer.worker.data.folders import (
    IMAGE_SUFFIXES,
    _archive,
    check_same_classes,
    find_source,
    members,
    resize_center,
    to_rgb,
)

PROGRESS_S = 5.0
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SMALL = 64
"""Images of this size or less train with CIFAR's recipe (pad-crop, CIFAR's mean and std); larger
ones with torchvision's reference recipe (random-resized crop, ImageNet's mean and std)."""
AUTO_MAX = 224
"""data.image_size=auto never goes above this (torchvision's models are made for 224 px)."""
DATA_MEMORY_SHARE = 0.4
"""The in-memory path is taken when the decoded set fits in this share of the memory it would live
in (the GPU's with data.device_resident, else this process's share of the host's)."""

if TYPE_CHECKING:
    import torch


def small(image_size: int) -> bool:
    return image_size <= SMALL


def store_size(image_size: int) -> int:
    """Side of the stored square images: the image size itself for small images; 8/7 of it (256 for
    224, torchvision's resize-then-centre-crop) for larger ones, so that random-resized crops and
    the test centre crop have a margin to come from."""
    return image_size if small(image_size) else round(image_size * 8 / 7)


def norm_stats(image_size: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return (CIFAR_MEAN, CIFAR_STD) if small(image_size) else (IMAGENET_MEAN, IMAGENET_STD)


@dataclass
class Split:
    images: torch.Tensor
    """uint8 [N, 3, S, S]: S = store_size(data.image_size)."""
    labels: torch.Tensor
    """int64 [N]."""
    classes: list[str]
    paths: list[str] | None = None
    """Each image's file (or shard:key) where the set has files: what a report names."""

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, n: int, seed: int) -> Split:
        if n <= 0 or n >= len(self):
            return self
        import torch

        idx = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))[:n].sort().values
        paths = [self.paths[i] for i in idx.tolist()] if self.paths else None
        return Split(self.images[idx].contiguous(), self.labels[idx].contiguous(), self.classes, paths)


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


@contextlib.contextmanager
def machine_lock(folder: Path, name: str):
    """An exclusive lock shared by every process of this machine that uses ``folder``."""
    if _writable(folder):
        lock_path = folder / f".{name}.lock"
    else:  # read-only data volume: lock in the temp folder, keyed by the folder's path
        key = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:12]
        lock_path = Path(tempfile.gettempdir()) / f"trainer-{name}-{key}.lock"
    with open(lock_path, "a+") as fh:  # closing it drops the lock
        flock(fh.fileno())
        yield


def _save_atomic(obj: dict, path: Path) -> None:
    import torch

    with replacing(path) as tmp:
        torch.save(obj, tmp)


def _cache_folders(cfg: Config) -> list[Path]:
    """Where the decoded cache may be, the first writable one for a new one. Your image folder is
    yours: its cache goes beside the run folders (``.data-cache`` of checkpoint.dir's parent, which
    the runs of that folder share), not among your images; a downloaded set's, beside it. A cache
    found in any of them is read (one a data step wrote beside the images too)."""
    if cfg.data.cache_dir:
        return [Path(cfg.data.cache_dir)]
    root, own = cfg.checkpoint.root.resolve().parent, cfg.checkpoint.root / ".data-cache"
    # not /.data-cache
    beside_runs = [root / ".data-cache"] if cfg.data.name == "imagefolder" and root != root.parent else []
    return [*beside_runs, Path(cfg.data.dir), own]


def _cache_file(cfg: Config, key: str) -> Path | None:
    return next((c / f"{key}.uint8.pt" for c in _cache_folders(cfg) if (c / f"{key}.uint8.pt").is_file()), None)


def _cached(cfg: Config, key: str, build) -> tuple[Split, Split]:
    """Load ``key`` from the cache, or build it (under the machine lock) and cache it."""
    import torch

    candidates = _cache_folders(cfg)
    ready = _cache_file(cfg, key)
    folder = ready.parent if ready else next((c for c in candidates if _writable(c)), None)
    if folder is None:
        warn(f"no writable cache folder among {[str(c) for c in candidates]}; decoding without a cache")
        return build()
    path = folder / f"{key}.uint8.pt"
    with machine_lock(folder, "cache"):  # read-only folder: the lock lives in the temp folder
        if not path.exists():
            train, test = build()
            _save_atomic(
                {
                    "train_x": train.images,
                    "train_y": train.labels,
                    "test_x": test.images,
                    "test_y": test.labels,
                    "classes": train.classes,
                    "test_paths": test.paths,
                },
                path,
            )
            return train, test
    try:
        blob = torch.load(path, weights_only=True)
        classes = list(blob["classes"])
        return Split(blob["train_x"], blob["train_y"], classes), Split(
            blob["test_x"], blob["test_y"], classes, blob.get("test_paths")
        )
    except Exception as e:  # noqa: BLE001 - a cut-short or overwritten cache: any load error means the same
        why = one_line(e, 100)
        warn(f"the data cache {path} is damaged ({e.__class__.__name__}: {why}); decoding the data set again")
        with machine_lock(folder, "cache"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return _cached(cfg, key, build)


# --------------------------------------------------------------------------------------------
# cifar10


class NotDownloaded(ConfigError):
    """CIFAR-10 is not in data.dir and could not be downloaded (``reason``: why, in one line)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _cifar10(cfg: Config) -> tuple[Split, Split]:
    import torch
    import torchvision

    root = Path(cfg.data.dir)

    def build() -> tuple[Split, Split]:
        splits = []
        with machine_lock(root if _writable(root) else Path(tempfile.gettempdir()), "download"):
            for train in (True, False):
                try:
                    ds = torchvision.datasets.CIFAR10(
                        str(root), train=train, download=cfg.data.download and _writable(root)
                    )
                except Exception as e:  # noqa: BLE001 - offline, read-only, checksum failure...
                    reason = one_line(e, 120)
                    raise NotDownloaded(
                        reason,
                        f"CIFAR-10 is not in data.dir={cfg.data.dir} and could not be downloaded ({reason}); put "
                        f"cifar-10-python.tar.gz there, or use data.name=imagefolder data.dir=PATH (a folder of "
                        f"train/ and test/ class folders or their .tar.gz; "
                        f"make run-local DATA=PATH)",
                    ) from None
                x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
                splits.append(Split(x, torch.tensor(ds.targets, dtype=torch.int64), list(ds.classes)))
        return splits[0], splits[1]

    return _cached(cfg, "cifar10", build)


# --------------------------------------------------------------------------------------------
# imagefolder


def check_archive(source: Path) -> None:
    """Read a tarball to its end without decoding any image (a second or so for CIFAR-10): a
    truncated or foreign file raises ConfigError before any worker starts."""
    if source.is_dir():
        return
    with _archive(source) as tar:
        for _ in tar:
            pass


def _decode(items, source: Path, side: int) -> tuple[torch.Tensor, list[str], list[str], list[str]]:
    """(uint8 images [N, 3, side, side], their class names, the names of those that did not decode,
    the names of those that did) from ``items`` of (class name, file name, bytes): an image folder's or tarball's
    members, or a
    shard split's images."""
    import torch
    from PIL import Image, UnidentifiedImageError

    images, names, bad, paths = [], [], [], []
    t0 = last = time.monotonic()
    say(f"decoding {source} into the uint8 cache (once per data set and machine) ...")
    for cls, name, raw in items:
        if time.monotonic() - last >= PROGRESS_S:  # a line every few seconds: 25 s of silence looks like a hang
            last = time.monotonic()
            say(f"  decoded {len(images):,} images in {last - t0:.0f} s")
        try:
            with Image.open(io.BytesIO(raw)) as im:
                im = resize_center(to_rgb(im), side)
                images.append(torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(side, side, 3))
                names.append(cls)
                paths.append(name)
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
            bad.append(name)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        warn(f"skipped {len(bad)} unreadable image(s): {', '.join(bad[:3])}{more}")
    say(f"  decoded {len(images):,} images of {source.name} in {time.monotonic() - t0:.1f} s")
    if not images and bad:
        raise ConfigError(
            f"{source}: none of its {len(bad)} image files could be decoded (first: {bad[0]}); replace them with "
            f"readable images"
        )
    if not images:
        raise ConfigError(
            f"{source} holds no class folders with images ({', '.join(IMAGE_SUFFIXES)}); expected "
            f"{source}/<class>/<image>"
        )
    return torch.stack(images).permute(0, 3, 1, 2).contiguous(), names, bad, paths


def _imagefolder_sources(cfg: Config) -> tuple[list[Path], str]:
    """The train and test folders or tarballs, and the cache key of their current contents."""
    root = Path(cfg.data.dir)
    if not root.is_dir():
        raise ConfigError(f"data.dir={root} does not exist; create it or point data.dir at the data set")
    sources = [find_source(root, s) for s in ("train", "test")]
    stamp = "|".join(f"{s.resolve()}:{s.stat().st_mtime_ns}:{s.stat().st_size}" for s in sources)
    side = store_size(cfg.data.image_size or 32)
    return sources, "imagefolder-" + hashlib.sha1(stamp.encode()).hexdigest()[:16] + (
        "" if side == 32 else f"-{side}px"
    )


def _imagefolder(cfg: Config) -> tuple[Split, Split]:
    import torch

    root = Path(cfg.data.dir)
    sources, key = _imagefolder_sources(cfg)

    def build() -> tuple[Split, Split]:
        decoded = [_decode(members(s), s, store_size(cfg.data.image_size or 32)) for s in sources]
        classes = sorted(set(decoded[0][1]))
        check_same_classes(classes, sorted(set(decoded[1][1])), str(root))
        index = {c: i for i, c in enumerate(classes)}
        return tuple(
            Split(x, torch.tensor([index[n] for n in names]), classes, paths) for x, names, _, paths in decoded
        )

    return _cached(cfg, key, build)


def median_short_side(root: Path, limit: int = 256) -> int | None:
    """The median shorter side of up to ``limit`` training images of an image folder (headers only),
    or None for a tarball (read only when decoded)."""
    from PIL import Image

    folder = root / "train"
    if not folder.is_dir():
        return None
    classes = sorted(p for p in folder.iterdir() if p.is_dir())
    sides = []
    for k in range(limit):  # round robin over the classes: every class, not the first one's sizes
        if not classes:
            break
        cls = classes[k % len(classes)]
        files = sorted(f for f in cls.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)[: limit // len(classes) + 1]
        i = k // len(classes)
        if i < len(files):
            with contextlib.suppress(OSError, SyntaxError, ValueError), Image.open(files[i]) as im:
                sides.append(min(im.size))
    return sorted(sides)[len(sides) // 2] if sides else None


def resolve_image_size(cfg: Config) -> tuple[int, str]:
    """(data.image_size with auto resolved, where it came from), for the start line."""
    if cfg.data.image_size:
        return cfg.data.image_size, "data.image_size"
    if cfg.data.name in ("cifar10", "synthetic"):
        return 32, "auto: the set's own"
    if cfg.data.name == "shards":
        from trainer.worker.data import shards

        side = shards.read_index(Path(cfg.data.dir), "train")["median_short_side"]
    else:
        side = median_short_side(Path(cfg.data.dir))
        if side is None:
            return 32, "auto: 32 for a tarball, whose sizes are known only once decoded"
    size = min(AUTO_MAX, side)
    return size, f"auto: the images' median shorter side {side} px" + (
        f", at most {AUTO_MAX}" if side > AUTO_MAX else ""
    )


def _resized(split: Split, side: int) -> Split:
    """A uint8 split at ``side`` x ``side`` (CIFAR-10 or the synthetic set at another data.image_size)."""
    if split.images.shape[-1] == side:
        return split
    import torch
    import torch.nn.functional as F

    out = torch.empty(len(split), 3, side, side, dtype=torch.uint8)
    for i in range(0, len(split), 1024):  # in chunks: the float copy of a whole set at 256 px is 4x its uint8 bytes
        x = F.interpolate(
            split.images[i : i + 1024].float(), size=(side, side), mode="bilinear", antialias=True, align_corners=False
        )
        out[i : i + 1024] = x.round().clamp(0, 255)
    return Split(out, split.labels, split.classes)


def _decode_shards(root: Path, side: int) -> tuple[Split, Split]:
    """Both splits decoded at ``side`` x ``side`` (shorter side, centre crop): the in-memory path
    of shards that fit."""
    import torch

    from trainer.worker.data.shards import ShardSet, check

    check(root)
    out = []
    for split in ("train", "test"):
        ds = ShardSet(root, split)
        x, names, _, paths = _decode(((ds.classes[label], where, raw) for raw, label, where in ds), root / split, side)
        index = {c: i for i, c in enumerate(ds.classes)}
        out.append(Split(x, torch.tensor([index[n] for n in names]), ds.classes, paths))
    return out[0], out[1]


# --------------------------------------------------------------------------------------------
# synthetic


def synthetic(n_train: int, n_test: int, seed: int = 1234) -> tuple[Split, Split]:
    """A learnable CIFAR-shaped set: each class is a smooth colour pattern, shifted and noised."""
    import torch

    g = torch.Generator().manual_seed(seed)
    templates = torch.nn.functional.interpolate(
        torch.rand(10, 3, 4, 4, generator=g), size=40, mode="bilinear", align_corners=False
    )

    def make(n: int) -> Split:
        y = torch.randint(0, 10, (n,), generator=g)
        dx, dy = torch.randint(0, 9, (2, n), generator=g)
        rows = (dy[:, None] + torch.arange(32))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(32))[:, None, None, :]
        x = templates[y[:, None, None, None], torch.arange(3)[None, :, None, None], rows, cols]
        x = x * 0.7 + 0.3 * torch.rand(n, 3, 32, 32, generator=g)
        return Split((x * 255).round().clamp(0, 255).to(torch.uint8), y, [f"class{i}" for i in range(10)])

    return make(n_train), make(n_test)


def load(cfg: Config) -> tuple[Split, Split]:
    """The train and test splits named by ``cfg.data``, subset as asked."""
    name, side = cfg.data.name, store_size(cfg.data.image_size or 32)
    if name == "synthetic":
        train, test = synthetic(cfg.data.synthetic_train_size, cfg.data.synthetic_test_size)
    elif name == "cifar10":
        train, test = _cifar10(cfg)
    elif name == "shards":
        from trainer.worker.data import shards

        train, test = _cached(
            cfg, shards.cache_key(Path(cfg.data.dir), side), lambda: _decode_shards(Path(cfg.data.dir), side)
        )
    else:
        train, test = _imagefolder(cfg)
    train, test = _resized(train, side), _resized(test, side)
    return train.subset(cfg.data.train_subset, seed=1), test.subset(cfg.data.test_subset, seed=2)


def ready(cfg: Config) -> bool:
    """Whether :func:`load` would only read its uint8 cache (nothing to download or decode). Needs
    no torch; raises ConfigError where an image folder's data is missing."""
    if cfg.data.name == "synthetic":
        return True
    if cfg.data.name == "shards":
        return True  # the workers decode (in memory) or stream it: nothing for the launcher to do
    key = "cifar10" if cfg.data.name == "cifar10" else _imagefolder_sources(cfg)[1]
    return _cache_file(cfg, key) is not None


# --------------------------------------------------------------------------------------------
# Which path: in memory or streamed


@dataclass
class Plan:
    """What the start line says of the data: where it comes from, its size, the path that runs."""

    source: str
    image_size: int
    size_why: str
    stream: bool
    path_why: str

    def describe(self, n_train: int, n_test: int, classes: int) -> str:
        return (
            f"{self.source}: {n_train:,} train / {n_test:,} test images, {classes} classes, {self.image_size} px "
            f"({self.size_why}) | "
            f"{self.path_why}"
        )


def memory_budget(cuda_total: int | None, local_procs: int) -> tuple[int, str]:
    """(bytes the decoded set may take, what that is a share of): the GPU's memory when the set
    would live there, else this process's share of the host's."""
    if cuda_total:
        return int(cuda_total * DATA_MEMORY_SHARE), f"{DATA_MEMORY_SHARE:.0%} of the GPU's {cuda_total / 2**30:.0f} GiB"
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    share = f" / {local_procs} processes" if local_procs > 1 else ""
    return int(
        host * DATA_MEMORY_SHARE / local_procs
    ), f"{DATA_MEMORY_SHARE:.0%} of the host's {host / 2**30:.0f} GiB{share}"


def _source(cfg: Config) -> str:
    return {
        "cifar10": f"CIFAR-10 ({cfg.data.dir})",
        "synthetic": "synthetic set (generated, not real images)",
        "shards": f"shards {cfg.data.dir}",
    }.get(cfg.data.name, f"image folder {cfg.data.dir}")


def train_images(cfg: Config) -> int | None:
    """Training images of an image folder (a listing) or of shards (their index); None for tarballs."""
    if cfg.data.name == "shards":
        from trainer.worker.data import shards

        return shards.read_index(Path(cfg.data.dir), "train")["images"]
    return _split_images(Path(cfg.data.dir) / "train")


def _split_images(folder: Path) -> int | None:
    """Images of a split's class folders (a listing, no decode); None for a tarball."""
    if not folder.is_dir():
        return None
    return sum(1 for c in folder.iterdir() if c.is_dir() for f in c.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)


def _count_images(cfg: Config) -> int | None:
    """Images of an image folder's class folders (a listing, no decode); None for tarballs."""
    counts = [_split_images(Path(cfg.data.dir) / split) for split in ("train", "test")]
    return None if None in counts else sum(counts)


def plan(cfg: Config, cuda_total: int | None, local_procs: int) -> Plan:
    """Resolve data.image_size (``plan.image_size``: the caller's config keeps what the user gave
    until the caller sets it) and decide the path: in memory where the decoded set fits in its
    budget (:func:`memory_budget`), else streamed from shards. An image folder too large for memory
    is refused, naming the command that shards it."""
    size, size_why = resolve_image_size(cfg)
    side = store_size(size)
    budget, of = memory_budget(cuda_total, local_procs)
    where = "on the GPU" if cuda_total else "in host memory"
    d = cfg.data
    if d.name == "shards":
        from trainer.worker.data import shards

        train, test = shards.check(Path(d.dir))
        need = (train["images"] + test["images"]) * 3 * side * side
        if d.loader == "stream" or (d.loader == "auto" and need > budget):
            why = "data.loader=stream" if d.loader == "stream" else f"{need / 2**30:.1f} GiB decoded > {of}"
            decode = "GPU" if d.decode == "gpu" else "CPU workers"
            return Plan(
                _source(cfg), size, size_why, True, f"streamed from shards, JPEGs decoded by the {decode} ({why})"
            )
        return Plan(
            _source(cfg), size, size_why, False, f"in memory, {where}: {need / 2**30:.2f} GiB decoded, within {of}"
        )
    if d.loader == "stream":
        raise ConfigError(
            f"data.loader=stream reads shards and data.name={d.name} is not; write them once with `trainer data "
            f"--shards OUT "
            f"data.name=imagefolder data.dir=IMAGES`, then train with data.name=shards data.dir=OUT"
        )
    n = {"cifar10": 60000, "synthetic": d.synthetic_train_size + d.synthetic_test_size}.get(d.name) or _count_images(
        cfg
    )
    need = (n or 0) * 3 * side * side
    if need > budget:
        raise ConfigError(
            f"{_source(cfg)} at {side} px needs {need / 2**30:.1f} GiB decoded, more than {of}; shard it once with "
            f"`trainer data "
            f"--shards OUT data.name=imagefolder data.dir={d.dir}` and train with data.name=shards data.dir=OUT "
            f"(streamed)"
        )
    shown = f": {need / 2**30:.2f} GiB decoded, within {of}" if n else ""
    return Plan(_source(cfg), size, size_why, False, f"in memory, {where}{shown}")
