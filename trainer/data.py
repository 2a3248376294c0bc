"""Data sets as uint8 tensors: CIFAR-10, image folders (or their .tar.gz) and a synthetic set.

Each data set is decoded once into a uint8 cache ([N, 3, 32, 32] images, int64 labels) so that
later runs, and the other processes of this one, read a single file. One process per machine does
the download or decode while the others wait on a file lock: no concurrent-download race, and no
process group is needed for it. trainer/loader.py turns these tensors into batches.

torch is imported inside the functions that need it: ``trainer launch`` asks :func:`ready` before
it starts torchrun, and a warm start should not pay torch's import (seconds) in the launcher too.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tarfile
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config import Config, ConfigError
from trainer.contract import one_line, say
from trainer.files import flock, replacing

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
PROGRESS_S = 5.0
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)

if TYPE_CHECKING:
    import torch


@dataclass
class Split:
    images: torch.Tensor
    """uint8 [N, 3, 32, 32]."""
    labels: torch.Tensor
    """int64 [N]."""
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, n: int, seed: int) -> Split:
        if n <= 0 or n >= len(self):
            return self
        import torch

        idx = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))[:n].sort().values
        return Split(self.images[idx].contiguous(), self.labels[idx].contiguous(), self.classes)


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
    return [Path(cfg.data.cache_dir)] if cfg.data.cache_dir else [Path(cfg.data.dir), Path(cfg.checkpoint.dir) / ".data-cache"]


def _cache_file(cfg: Config, key: str) -> Path | None:
    return next((c / f"{key}.uint8.pt" for c in _cache_folders(cfg) if (c / f"{key}.uint8.pt").is_file()), None)


def _cached(cfg: Config, key: str, build) -> tuple[Split, Split]:
    """Load ``key`` from the cache, or build it (under the machine lock) and cache it."""
    import torch

    candidates = _cache_folders(cfg)
    ready = _cache_file(cfg, key)
    folder = ready.parent if ready else next((c for c in candidates if _writable(c)), None)
    if folder is None:
        warnings.warn(f"no writable cache folder among {[str(c) for c in candidates]}; decoding without a cache", stacklevel=2)
        return build()
    path = folder / f"{key}.uint8.pt"
    with machine_lock(folder, "cache"):  # read-only folder: the lock lives in the temp folder
        if not path.exists():
            train, test = build()
            _save_atomic({"train_x": train.images, "train_y": train.labels, "test_x": test.images,
                          "test_y": test.labels, "classes": train.classes}, path)
            return train, test
    try:
        blob = torch.load(path, weights_only=True)
        classes = list(blob["classes"])
        return Split(blob["train_x"], blob["train_y"], classes), Split(blob["test_x"], blob["test_y"], classes)
    except Exception as e:  # noqa: BLE001 - a cut-short or overwritten cache: any load error means the same
        why = one_line(e, 100)
        warnings.warn(f"the data cache {path} is damaged ({e.__class__.__name__}: {why}); decoding the data set again", stacklevel=2)
        with machine_lock(folder, "cache"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return _cached(cfg, key, build)


# --------------------------------------------------------------------------------------------
# cifar10


def _cifar10(cfg: Config) -> tuple[Split, Split]:
    import torch
    import torchvision

    root = Path(cfg.data.dir)

    def build() -> tuple[Split, Split]:
        splits = []
        with machine_lock(root if _writable(root) else Path(tempfile.gettempdir()), "download"):
            for train in (True, False):
                try:
                    ds = torchvision.datasets.CIFAR10(str(root), train=train, download=cfg.data.download and _writable(root))
                except Exception as e:  # noqa: BLE001 - offline, read-only, checksum failure...
                    reason = one_line(e, 120)
                    raise ConfigError(
                        f"CIFAR-10 is not in data.dir={cfg.data.dir} and could not be downloaded ({reason}); put "
                        f"cifar-10-python.tar.gz there, or use data.name=imagefolder data.dir=PATH (a folder of train/ and test/ class folders or their .tar.gz; "
                        f"make run-local DATA=PATH)"
                    ) from None
                x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
                splits.append(Split(x, torch.tensor(ds.targets, dtype=torch.int64), list(ds.classes)))
        return splits[0], splits[1]

    return _cached(cfg, "cifar10", build)


# --------------------------------------------------------------------------------------------
# imagefolder


def _find_source(root: Path, split: str) -> Path:
    folder = root / split
    if folder.is_dir():
        if not any(p.is_dir() for p in folder.iterdir()):
            raise ConfigError(f"{folder} holds no class folders; expected {folder}/<class>/<image>")
        return folder
    tars = sorted(p for p in root.glob(f"*{split}*.tar.gz")) + sorted(root.glob(f"*{split}*.tgz"))
    if tars:
        return tars[0]
    raise ConfigError(
        f"data.dir={root} has no {split}/ folder of class folders and no *{split}*.tar.gz; "
        f"point data.dir at a folder holding train/ and test/ class folders (or their .tar.gz)"
    )


def _members(source: Path):
    """Yield (class name, file name, bytes) for every image under ``source``."""
    if source.is_dir():
        for cls_dir in sorted(p for p in source.iterdir() if p.is_dir()):
            for f in sorted(cls_dir.iterdir()):
                if f.suffix.lower() in IMAGE_SUFFIXES:
                    yield cls_dir.name, str(f), f.read_bytes()
        return
    with _archive(source) as tar:
        for m in tar:
            parts = Path(m.name).parts
            if m.isfile() and len(parts) >= 2 and Path(m.name).suffix.lower() in IMAGE_SUFFIXES:
                fh = tar.extractfile(m)
                if fh is not None:
                    yield parts[-2], f"{source}:{m.name}", fh.read()


@contextlib.contextmanager
def _archive(source: Path):
    """An open tarball; a file that is not one, is cut short or has bad gzip data (found while
    reading it) becomes one ConfigError that names the fix."""
    try:
        with tarfile.open(source, "r:*") as tar:
            yield tar
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        why = one_line(e, 100) or e.__class__.__name__
        raise ConfigError(f"{source} is not a complete .tar.gz archive ({why}); download or copy it again, "
                          f"or unpack it into {source.parent}/<split>/<class>/") from None


def check_archive(source: Path) -> None:
    """Read a tarball to its end without decoding any image (a second or so for CIFAR-10): a
    truncated or foreign file raises ConfigError before any worker starts."""
    if source.is_dir():
        return
    with _archive(source) as tar:
        for _ in tar:
            pass


def _decode_folder(source: Path) -> tuple[torch.Tensor, list[str], list[str]]:
    import torch
    from PIL import Image, UnidentifiedImageError

    images, names, bad = [], [], []
    t0 = last = time.monotonic()
    say(f"decoding {source} into the uint8 cache (once per data set and machine) ...")
    for cls, name, raw in _members(source):
        if time.monotonic() - last >= PROGRESS_S:  # a line every few seconds: 25 s of silence looks like a hang
            last = time.monotonic()
            say(f"  decoded {len(images):,} images in {last - t0:.0f} s")
        try:
            with Image.open(io.BytesIO(raw)) as im:
                im = im.convert("RGB")
                if im.size != (32, 32):
                    im = im.resize((32, 32), Image.BILINEAR)
                images.append(torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(32, 32, 3))
                names.append(cls)
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
            bad.append(name)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        warnings.warn(f"skipped {len(bad)} unreadable image(s): {', '.join(bad[:3])}{more}", stacklevel=2)
    say(f"  decoded {len(images):,} images of {source.name} in {time.monotonic() - t0:.1f} s")
    if not images and bad:
        raise ConfigError(f"{source}: none of its {len(bad)} image files could be decoded (first: {bad[0]}); replace them with readable images")
    if not images:
        raise ConfigError(f"{source} holds no class folders with images ({', '.join(IMAGE_SUFFIXES)}); expected {source}/<class>/<image>")
    return torch.stack(images).permute(0, 3, 1, 2).contiguous(), names, bad


def _imagefolder_sources(cfg: Config) -> tuple[list[Path], str]:
    """The train and test folders or tarballs, and the cache key of their current contents."""
    root = Path(cfg.data.dir)
    if not root.is_dir():
        raise ConfigError(f"data.dir={root} does not exist; create it or point data.dir at the data set")
    sources = [_find_source(root, s) for s in ("train", "test")]
    stamp = "|".join(f"{s.resolve()}:{s.stat().st_mtime_ns}:{s.stat().st_size}" for s in sources)
    return sources, "imagefolder-" + hashlib.sha1(stamp.encode()).hexdigest()[:16]


def _imagefolder(cfg: Config) -> tuple[Split, Split]:
    import torch

    root = Path(cfg.data.dir)
    sources, key = _imagefolder_sources(cfg)

    def build() -> tuple[Split, Split]:
        decoded = [_decode_folder(s) for s in sources]
        classes = sorted(set(decoded[0][1]))
        if sorted(set(decoded[1][1])) != classes:
            raise ConfigError(f"train and test of {root} have different class folders; give both the same classes")
        index = {c: i for i, c in enumerate(classes)}
        return tuple(Split(x, torch.tensor([index[n] for n in names]), classes) for x, names, _ in decoded)

    return _cached(cfg, key, build)


# --------------------------------------------------------------------------------------------
# synthetic


def synthetic(n_train: int, n_test: int, seed: int = 1234) -> tuple[Split, Split]:
    """A learnable CIFAR-shaped set: each class is a smooth colour pattern, shifted and noised."""
    import torch

    g = torch.Generator().manual_seed(seed)
    templates = torch.nn.functional.interpolate(torch.rand(10, 3, 4, 4, generator=g), size=40, mode="bilinear", align_corners=False)

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
    name = cfg.data.name
    if name == "synthetic":
        train, test = synthetic(cfg.data.synthetic_train_size, cfg.data.synthetic_test_size)
    elif name == "cifar10":
        train, test = _cifar10(cfg)
    else:
        train, test = _imagefolder(cfg)
    return train.subset(cfg.data.train_subset, seed=1), test.subset(cfg.data.test_subset, seed=2)


def ready(cfg: Config) -> bool:
    """Whether :func:`load` would only read its uint8 cache (nothing to download or decode). Needs
    no torch; raises ConfigError where an image folder's data is missing."""
    if cfg.data.name == "synthetic":
        return True
    key = "cifar10" if cfg.data.name == "cifar10" else _imagefolder_sources(cfg)[1]
    return _cache_file(cfg, key) is not None
