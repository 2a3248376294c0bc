"""Shards: an image folder (or its .tar.gz) written once as WebDataset tar files, read by index.

``trainer data --shards OUT`` writes ``OUT/train-NNNNNN.tar`` and ``OUT/test-NNNNNN.tar`` with
webdataset's ShardWriter (each sample ``KEY.jpg`` and ``KEY.cls``), and ``OUT/train.json`` and
``OUT/test.json`` in wids' shard-index format (each shard's file, samples and bytes) with the class
names and the images' median shorter side beside it. Any WebDataset or wids tool reads them.

Reading is by sample index: the trainer's order (a permutation of the whole set per epoch, every
rank its share of each global batch; trainer/worker/data/stream.py) needs any sample at any time.
webdataset's own reader streams each shard from its start, so its order depends on how shards
are split over ranks and workers. wids reads by index, but its IndexedTarSamples keeps Python
objects for every member of every shard it opens: 77 MB per 10,000-image shard in each process
(measured on CIFAR-10's shards), so host memory grows with the set. Hence ``OUT/SPLIT.offsets.npy``,
written beside the tars: where each image's bytes start in which shard, their length and its
label, 20 bytes per image, memory-mapped (the page cache shares it between processes), and a read
is one ``os.pread``. Open shard files are kept in a small LRU (a set of many shards, few descriptors).

Every image is decoded once here, while the shards are written: one that does not decode is
skipped and counted, PNG, grayscale, CMYK and transparent images become RGB JPEGs (what the GPU's
decoder takes), and images larger than ``max_side`` are scaled down. Baseline RGB JPEGs of a fitting
size keep their bytes.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterator
from multiprocessing import get_context
from pathlib import Path

from trainer.config import ConfigError
from trainer.contract import one_line, say, warn

KIND = "wids-shard-index-v1"
MAX_COUNT = 10_000
"""Images per shard at most (and MAX_BYTES): a few hundred shards for ImageNet, few open files."""
MAX_BYTES = 512 << 20
OPEN_FILES = 64
"""Shard files a process keeps open (least recently used closed first)."""
ROW = [("shard", "<i4"), ("offset", "<i8"), ("size", "<i4"), ("label", "<i4")]
"""One image in SPLIT.offsets.npy."""


def _prepare(item: tuple[int, str, str, bytes, int]) -> tuple[int, str, bytes | None, int]:
    """(index, class, JPEG bytes or None when the image does not decode, its shorter side)."""
    from PIL import Image

    from trainer.worker.data.folders import to_rgb

    i, cls, name, raw, max_side = item
    try:
        with Image.open(io.BytesIO(raw)) as im:
            im.load()
            keep = (
                im.format == "JPEG"
                and im.mode == "RGB"
                and not im.info.get("progressive")
                and (not max_side or min(im.size) <= max_side)
            )
            if keep:
                return i, cls, raw, min(im.size)
            rgb = to_rgb(im)
            if max_side and min(rgb.size) > max_side:
                scale = max_side / min(rgb.size)
                rgb = rgb.resize(
                    (max(1, round(rgb.size[0] * scale)), max(1, round(rgb.size[1] * scale))), Image.BILINEAR
                )
            out = io.BytesIO()
            rgb.save(out, format="JPEG", quality=95)
            return i, cls, out.getvalue(), min(rgb.size)
    except (OSError, SyntaxError, ValueError) as e:
        return i, cls, f"{name}: {one_line(e, 80)}".encode(), -1


def write(source_root: Path, out: Path, max_side: int = 512, workers: int | None = None) -> dict[str, dict]:
    """Write the train and test splits of ``source_root`` (class folders or their .tar.gz) as
    shards in ``out``; returns each split's index. Images are read in the folder's sorted order."""
    from trainer.worker.data.folders import check_same_classes, find_source

    if not source_root.is_dir():
        raise ConfigError(
            f"{source_root} does not exist; point it at a folder of train/ and test/ class folders (or their .tar.gz)"
        )
    out.mkdir(parents=True, exist_ok=True)
    workers = workers or max(1, min(16, os.cpu_count() or 1))
    # written in a folder of their own, moved into place when both splits are whole: a failed or
    # stopped write (a class mismatch, a full disk, Ctrl-C) leaves no part of a shard set behind
    work = Path(tempfile.mkdtemp(prefix=".writing-", dir=out))
    try:
        indexes = {
            split: _write_split(find_source(source_root, split), work, split, max_side, workers)
            for split in ("train", "test")
        }
        check_same_classes(indexes["train"]["classes"], indexes["test"]["classes"], str(source_root))
        for split, index in indexes.items():
            for old in out.glob(f"{split}-*.tar"):
                old.unlink()
            for f in [*sorted(work.glob(f"{split}-*.tar")), work / f"{split}.offsets.npy"]:
                f.replace(out / f.name)
            (out / f"{split}.json").write_text(json.dumps(index, indent=1))  # the index last: it names the shards
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return indexes


def _write_split(source: Path, out: Path, split: str, max_side: int, workers: int) -> dict:
    """One split's shards (images checked and converted by ``workers`` processes) and its index."""
    import webdataset as wds

    from trainer.worker.data.folders import members

    t0 = last = time.monotonic()
    sides, bad, classes = [], [], set()
    items = ((i, cls, name, raw, max_side) for i, (cls, name, raw) in enumerate(members(source)))
    with (
        get_context("fork").Pool(workers) as pool,
        wds.ShardWriter(str(out / f"{split}-%06d.tar"), maxcount=MAX_COUNT, maxsize=MAX_BYTES, verbose=0) as sink,
    ):
        for _, cls, jpeg, side in pool.imap(_prepare, items, chunksize=64):
            if side < 0:
                bad.append(jpeg.decode())
                continue
            classes.add(cls)
            sink.write({"__key__": f"{len(sides):09d}", "jpg": jpeg, "cls": cls.encode()})
            sides.append(side)
            if time.monotonic() - last >= 5:
                last = time.monotonic()
                say(f"  {split}: {len(sides):,} images in {last - t0:.0f} s")
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        warn(f"skipped {len(bad)} unreadable image(s) of {split}: {'; '.join(bad[:3])}{more}")
    if not sides:
        raise ConfigError(f"{source} holds no readable images; expected {source}/<class>/<image>")
    index = _index(out, split, classes, sides, bad)
    say(
        f"  {split}: {len(sides):,} images, {len(classes)} classes in {len(index['shardlist'])} shard(s), "
        f"{time.monotonic() - t0:.1f} s"
    )
    return index


def _index(out: Path, split: str, classes: set, sides: list[int], bad: list[str]) -> dict:
    """The split's index (wids' form, with this trainer's counts), its offsets table written beside it."""
    shards = [{"url": p.name, "nsamples": 0, "filesize": p.stat().st_size} for p in sorted(out.glob(f"{split}-*.tar"))]
    index = {"__kind__": KIND, "wids_version": 1, "name": split, "classes": sorted(classes), "images": len(sides)}
    index.update(skipped=len(bad), median_short_side=sorted(sides)[len(sides) // 2], shardlist=shards)
    _offsets(out, split, index)
    return index


def _offsets(out: Path, split: str, index: dict) -> None:
    """SPLIT.offsets.npy from the tars just written (their members' data offsets), and each
    shard's sample count into ``index``."""
    import tarfile

    import numpy as np

    label = {c: i for i, c in enumerate(index["classes"])}
    rows = []
    for k, shard in enumerate(index["shardlist"]):
        jpgs, classes = {}, {}
        with tarfile.open(out / shard["url"]) as tar:
            for m in tar:
                key, ext = m.name.rsplit(".", 1)
                if ext == "jpg":
                    jpgs[key] = m
                elif ext == "cls":
                    classes[key] = tar.extractfile(m).read().decode()
        for key in sorted(jpgs):
            rows.append((k, jpgs[key].offset_data, jpgs[key].size, label[classes[key]]))
        shard["nsamples"] = len(jpgs)
    np.save(out / f"{split}.offsets.npy", np.array(rows, dtype=ROW))


def read_index(root: Path, split: str) -> dict:
    """A split's index; a missing or foreign one is a usage error naming the fix."""
    path = root / f"{split}.json"
    fix = f"write shards with `trainer data --shards {root} data.name=imagefolder data.dir=IMAGES`"
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"data.name=shards: {path} does not exist; {fix}, or use data.name=imagefolder for a folder of images"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a shard index ({one_line(e, 80)}); {fix}") from None
    if index.get("__kind__") != KIND or "classes" not in index:
        raise ConfigError(f"{path} is not a shard index of this trainer; {fix}")
    return index


def check(root: Path) -> tuple[dict, dict]:
    """Both splits' indexes, every shard present at its recorded size, the same classes."""
    from trainer.worker.data.folders import check_same_classes

    indexes = read_index(root, "train"), read_index(root, "test")
    for index in indexes:
        for shard in index["shardlist"]:
            path = root / shard["url"]
            try:
                size = path.stat().st_size
            except OSError as e:
                raise ConfigError(
                    f"shard {path} is missing or unreadable ({e.strerror}); copy it back or write the shards again"
                ) from None
            if shard.get("filesize") not in (None, size):
                raise ConfigError(
                    f"shard {path} has {size} bytes, its index says {shard['filesize']}: it is cut short or replaced; "
                    f"copy it again or write the shards again"
                )
    check_same_classes(indexes[0]["classes"], indexes[1]["classes"], str(root))
    for split, index in zip(("train", "test"), indexes, strict=True):
        if len(ShardSet(root, split)) != index["images"]:
            raise ConfigError(
                f"{root / (split + '.offsets.npy')} does not match {split}.json; write the shards again with trainer "
                f"data --shards"
            )
    return indexes


def cache_key(root: Path, side: int) -> str:
    """The in-memory cache's key of shards decoded at ``side``: changes when a shard does."""
    import hashlib

    stamp = "|".join(
        f"{(root / s['url']).resolve()}:{s.get('filesize')}"
        for split in ("train", "test")
        for s in read_index(root, split)["shardlist"]
    )
    return f"shards-{hashlib.sha1(stamp.encode()).hexdigest()[:16]}-{side}px"


class ShardSet:
    """One split's samples by index: (JPEG bytes, label, 'shard:key'). The offset table is mapped
    from disk; shard files open on first use, in the process that reads them (each DataLoader
    worker its own descriptors)."""

    def __init__(self, root: Path, split: str):
        import numpy as np

        self.root, self.index = root, read_index(root, split)
        self.classes: list[str] = self.index["classes"]
        self.urls = [s["url"] for s in self.index["shardlist"]]
        table = root / f"{split}.offsets.npy"
        try:
            self.rows = np.load(table, mmap_mode="r")
        except FileNotFoundError:
            raise ConfigError(f"{table} is missing; write the shards again with trainer data --shards") from None
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ConfigError(
                f"{table} is damaged ({one_line(why, 80)}); write the shards again with trainer data --shards"
            ) from None
        self.open: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.rows)

    def __getstate__(self) -> dict:  # a worker opens its own files
        return {**self.__dict__, "open": OrderedDict()}

    def _fd(self, k: int) -> int:
        if k in self.open:
            self.open.move_to_end(k)
            return self.open[k]
        path = self.root / self.urls[k]
        try:
            self.open[k] = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ConfigError(
                f"shard {path} cannot be read ({e.strerror}); copy it again or write the shards again"
            ) from None
        if len(self.open) > OPEN_FILES:
            os.close(self.open.popitem(last=False)[1])
        return self.open[k]

    def __getitem__(self, i: int) -> tuple[bytes, int, str]:
        shard, offset, size, label = self.rows[i].tolist()
        return os.pread(self._fd(shard), size, offset), label, self._name(shard, i)

    def name(self, i: int) -> str:
        """Sample ``i``'s name (shard:index), read from the offset table alone."""
        return self._name(int(self.rows[i][0]), i)

    def _name(self, shard: int, i: int) -> str:
        return f"{self.urls[shard]}:{i:09d}"

    def __iter__(self) -> Iterator[tuple[bytes, int, str]]:
        return (self[i] for i in range(len(self)))
