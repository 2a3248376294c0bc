"""Image folders and their tarballs: finding a split, reading its images' bytes in sorted order,
turning any image into 8-bit RGB at a size. What the in-memory cache (trainer/worker/data/__init__.py) and the
shard writer (trainer/worker/data/shards.py) both read with."""

from __future__ import annotations

import contextlib
import tarfile
import zlib
from pathlib import Path

from trainer.config import ConfigError
from trainer.contract import one_line

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def find_source(root: Path, split: str) -> Path:
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


def members(source: Path):
    """Yield (class name, file name, bytes) for every image under ``source``. A class folder
    without images is a usage error: its class would exist with nothing to learn it from."""
    if source.is_dir():
        for cls_dir in sorted(p for p in source.iterdir() if p.is_dir()):
            files = sorted(f for f in cls_dir.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise ConfigError(
                    f"class folder {cls_dir} holds no images ({', '.join(IMAGE_SUFFIXES)}); add images or remove the "
                    f"folder"
                )
            for f in files:
                yield cls_dir.name, str(f), f.read_bytes()
        return
    with _archive(source) as tar:
        for m in tar:
            parts = Path(m.name).parts
            if m.isfile() and len(parts) >= 2 and Path(m.name).suffix.lower() in IMAGE_SUFFIXES:
                fh = tar.extractfile(m)
                if fh is not None:
                    yield parts[-2], f"{source}:{m.name}", fh.read()


def to_rgb(im):
    """A PIL image as 8-bit RGB: grayscale, palette and CMYK converted; transparency laid over
    white (what a viewer shows), not dropped to whatever colour the transparent pixels hold.
    16-bit grayscale (a PNG's or TIFF's modes I;16 and I) is scaled to 8 bits: PIL's own convert
    clips it, and every pixel above 255 trains as white. Floating-point pixels (mode F) have no
    range to scale from: ValueError, so the image is skipped and named."""
    from PIL import Image

    if im.mode.startswith("I;16") or im.mode == "I":
        if im.mode == "I" and im.getextrema()[1] > 65535:
            raise ValueError("32-bit integer pixels: save it as an 8- or 16-bit image")
        im = im.convert("I").point(lambda v: v * (1 / 257)).convert("L")
    elif im.mode == "F":
        raise ValueError("floating-point pixels (mode F): save it as an 8- or 16-bit image")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        im = im.convert("RGBA")
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, im).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


def resize_center(im, side: int):
    """Shorter side to ``side`` (bilinear, antialiased), then the centre ``side`` x ``side``:
    torchvision's Resize + CenterCrop. An image already that size is left as it is."""
    from PIL import Image

    w, h = im.size
    if (w, h) == (side, side):
        return im
    scale = side / min(w, h)
    nw, nh = max(side, round(w * scale)), max(side, round(h * scale))
    im = im.resize((nw, nh), Image.BILINEAR)
    left, top = (nw - side) // 2, (nh - side) // 2
    return im.crop((left, top, left + side, top + side))


@contextlib.contextmanager
def _archive(source: Path):
    """An open tarball; a file that is not one, is cut short or has bad gzip data (found while
    reading it) becomes one ConfigError that names the fix."""
    try:
        with tarfile.open(source, "r:*") as tar:
            yield tar
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        why = one_line(e, 100) or e.__class__.__name__
        raise ConfigError(
            f"{source} is not a complete .tar.gz archive ({why}); download or copy it again, "
            f"or unpack it into {source.parent}/<split>/<class>/"
        ) from None


def check_same_classes(train: list[str], test: list[str], where: str) -> None:
    if train != test:
        only_train, only_test = sorted(set(train) - set(test)), sorted(set(test) - set(train))
        diff = "; ".join(
            f"only in {s}: {', '.join(c[:3])}{' ...' if len(c) > 3 else ''}"
            for s, c in (("train", only_train), ("test", only_test))
            if c
        )
        raise ConfigError(
            f"train and test of {where} have different classes ({diff}); give both the same class folders"
        )
