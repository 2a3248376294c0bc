"""``trainer predict SOURCE IMAGES...``: the top-k classes of images, by a checkpoint or an
exported model (trainer/worker/trained.py opens either).

IMAGES are files, folders (every image under them) or a shards folder (its splits' images).
Each image gets the evaluation's preprocessing: the centre of the image at the stored size (8/7
of the image size above 64 px), then the centre crop; the run's mean and std.

On a GPU, DataLoader workers only read the JPEGs' bytes; the GPU decodes each batch in one nvjpeg
call and crops and resizes it in one roi_align (the streamed evaluation's own path,
trainer/worker/data/stream.py), and the model runs in bf16 and channels-last, as training evaluates:
the host's cores no longer set the pace. Elsewhere (the CPU; a PNG, or any image that is not a
JPEG) the workers decode with PIL, a JPEG at the smallest DCT scale that still covers the size
(PIL's draft: a large photo decodes at a fraction of the cost). An unreadable file is one line,
skipped and counted; only a run where no image could be read is an error (exit 2).
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from trainer.config import ConfigError
from trainer.contract import one_line
from trainer.worker.data import store_size
from trainer.worker.data.folders import IMAGE_SUFFIXES, resize_center, to_rgb
from trainer.worker.trained import Trained


def find_images(paths: list[str]) -> list[tuple]:
    """Each image as a reference a worker can read: ("file", path) or ("shard", root, split, i)."""
    found: list[tuple] = []
    for given in paths:
        p = Path(given)
        if not p.exists():
            raise ConfigError(f"{given} does not exist; give image files, folders of images or a shards folder")
        splits = [s for s in ("test", "train") if (p / f"{s}.json").is_file()] if p.is_dir() else []
        if splits:
            from trainer.worker.data.shards import ShardSet

            found += [("shard", str(p), s, i) for s in splits for i in range(len(ShardSet(p, s)))]
        elif p.is_dir():
            found += [
                ("file", str(f)) for f in sorted(p.rglob("*")) if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file()
            ]
        else:
            found.append(("file", str(p)))
    if not found:
        raise ConfigError(
            f"no images ({', '.join(IMAGE_SUFFIXES)}) in {', '.join(paths)}; give image files, folders of them or a "
            f"shards folder"
        )
    return found


JPEG = b"\xff\xd8\xff"


class Images(Dataset):
    """Reference i -> (uint8 [3, S, S], or a JPEG's bytes with ``raw_jpegs``, or None; i, name,
    why it could not be read)."""

    def __init__(self, refs: list[tuple], image_size: int, raw_jpegs: bool = False):
        self.refs, self.size, self.side, self.raw_jpegs = refs, image_size, store_size(image_size), raw_jpegs
        self.shards: dict = {}

    def __len__(self) -> int:
        return len(self.refs)

    def _read(self, ref: tuple) -> tuple[bytes, str]:
        if ref[0] == "file":
            return Path(ref[1]).read_bytes(), ref[1]
        from trainer.worker.data.shards import ShardSet

        key = (ref[1], ref[2])
        if key not in self.shards:
            self.shards[key] = ShardSet(Path(ref[1]), ref[2])
        raw, _, name = self.shards[key][ref[3]]
        return raw, f"{ref[1]}/{ref[2]}/{name}"

    def __getitem__(self, i: int):
        from PIL import Image

        name = self.refs[i][-1] if self.refs[i][0] == "file" else str(self.refs[i])
        try:
            raw, name = self._read(self.refs[i])
            if self.raw_jpegs and raw.startswith(JPEG):  # the GPU decodes it
                return torch.frombuffer(bytearray(raw), dtype=torch.uint8), i, name, "raw"
            with Image.open(io.BytesIO(raw)) as im:
                # JPEG: decode at the smallest scale that still covers the resize
                im.draft("RGB", (self.side, self.side))
                im = resize_center(to_rgb(im), self.side)
                x = (
                    torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
                    .view(self.side, self.side, 3)
                    .permute(2, 0, 1)
                )
        except Image.UnidentifiedImageError:
            return None, i, name, "no image format PIL knows"
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            return None, i, name, one_line(e, 80)
        o = (self.side - self.size) // 2
        return x[:, o : o + self.size, o : o + self.size].contiguous(), i, name, ""


def _batch(items: list) -> tuple:
    """(decoded uint8 images, their names, JPEG bytes, their names, [(unreadable, why)], the
    readable images' positions in the input: decoded ones first, then the JPEGs)."""
    from trainer.worker.data.stream import one_buffer

    decoded = [it for it in items if it[0] is not None and it[3] != "raw"]
    raws = [it for it in items if it[3] == "raw"]
    x = torch.stack([it[0] for it in decoded]) if decoded else None
    return (
        x,
        [it[2] for it in decoded],
        one_buffer([it[0] for it in raws]),
        [it[2] for it in raws],
        [(it[2], it[3]) for it in items if it[0] is None],
        [it[1] for it in decoded + raws],
    )


def decode_jpegs(
    raws: tuple[torch.Tensor, list[int]], size: int, device: torch.device
) -> tuple[torch.Tensor | None, list[bool]]:
    """A batch of JPEGs on the GPU: (float [n, 3, size, size] 0-255 centre crops of those that
    decoded, which did). One nvjpeg call; where one image fails it, each alone finds which."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from trainer.worker.data.stream import boxes, crop_batch, decode_each

    views = list(torch.split(raws[0], raws[1]))  # nvjpeg reads the bytes from host memory
    try:
        images = decode_jpeg(views, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:  # one bad JPEG fails the batched call
        images, _ = decode_each(views, lambda raw: decode_jpeg(raw, mode=ImageReadMode.RGB, device=device))
    decoded = [im is not None for im in images]
    images = [im for im in images if im is not None]
    if not images:
        return None, decoded
    at, mirror = boxes(images, size, None, False)
    return crop_batch(images, at, mirror, size), decoded


@dataclass
class Prediction:
    name: str
    top: list[tuple[str, float]]


def predict(
    model: Trained,
    refs: list[tuple],
    top_k: int,
    batch_size: int,
    workers: int,
    say=print,
    jpegs_on_device: bool | None = None,
):
    """Yields a Prediction per readable image, in order; an unreadable one is said and skipped.
    ``jpegs_on_device``: JPEGs decoded by torchvision on the model's device (default: on a GPU)."""
    cuda = torch.cuda.is_available() and model.session is None
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device)
    if cuda:
        model.module.to(memory_format=torch.channels_last)
    k = min(top_k, len(model.classes))
    raw = cuda if jpegs_on_device is None else jpegs_on_device
    loader = DataLoader(
        Images(refs, model.image_size, raw_jpegs=raw),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=_batch,
        pin_memory=cuda,
        persistent_workers=False,
    )
    for decoded, names, raws, raw_names, bad, at in loader:
        parts = [] if decoded is None else [decoded.to(device, non_blocking=True).float()]
        if raw_names:
            on_gpu, decoded = decode_jpegs(raws, model.image_size, device)
            bad += [(n, "a JPEG nvjpeg cannot decode") for n, ok in zip(raw_names, decoded, strict=True) if not ok]
            at = at[: len(names)] + [i for i, ok in zip(at[len(names) :], decoded, strict=True) if ok]
            names += [n for n, ok in zip(raw_names, decoded, strict=True) if ok]
            parts += [] if on_gpu is None else [on_gpu]
        for name, why in bad:
            say(f"skipped {name}: not a readable image ({why})")
        if not parts:
            continue
        order = sorted(range(len(at)), key=at.__getitem__)  # the input's order
        names = [names[j] for j in order]
        x = (torch.cat(parts) if len(parts) > 1 else parts[0])[torch.tensor(order, device=device)]
        if cuda:
            x = x.contiguous(memory_format=torch.channels_last)
        x = model.normalize(x)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            probs = model.logits(x).float().softmax(1)
        p, c = probs.topk(k, dim=1)
        for name, ps, cs in zip(names, p.tolist(), c.tolist(), strict=True):
            yield Prediction(name, [(model.classes[j], q) for j, q in zip(cs, ps, strict=True)])


class Writer:
    """--out FILE: JSON lines (.jsonl, .json) or CSV (.csv), by its suffix."""

    def __init__(self, path: str | None, top_k: int):
        self.path, self.fh, self.csv = path, None, None
        if path is None:
            return
        suffix = Path(path).suffix.lower()
        if suffix not in (".jsonl", ".json", ".csv"):
            raise ConfigError(f"--out {path}: the file's suffix picks the format; use .jsonl (JSON lines) or .csv")
        self.fh = open(path, "w", newline="")  # noqa: SIM115 - closed in close()
        if suffix == ".csv":
            self.csv = csv.writer(self.fh)
            self.csv.writerow(["file"] + [f"{what}{i}" for i in range(1, top_k + 1) for what in ("class", "prob")])

    def write(self, p: Prediction) -> None:
        if self.csv is not None:
            self.csv.writerow([p.name] + [v for c, q in p.top for v in (c, f"{q:.6f}")])
        elif self.fh is not None:
            self.fh.write(
                json.dumps({"file": p.name, "top": [{"class": c, "prob": round(q, 6)} for c, q in p.top]}) + "\n"
            )

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


def run(
    source: str, images: list[str], top_k: int, out: str | None, batch_size: int, quiet: bool
) -> tuple[int, int, Trained]:
    """(images predicted, images skipped, the model): the table on stdout, lines on stderr."""
    from trainer.worker.trained import open_trained

    if top_k < 1 or batch_size < 1:
        raise ConfigError("--top-k and --batch-size must be at least 1")
    model = open_trained(source)
    refs = find_images(images)
    writer = Writer(out, min(top_k, len(model.classes)))
    workers = min(8, len(os.sched_getaffinity(0)), max(1, len(refs) // batch_size))
    done = skipped = 0

    def skip(line: str) -> None:
        nonlocal skipped
        skipped += 1
        print(line, file=sys.stderr)

    try:
        for p in predict(model, refs, top_k, batch_size, workers, say=skip):
            done += 1
            writer.write(p)
            if not quiet:
                print(p.name + "\t" + "\t".join(f"{c} {q:.3f}" for c, q in p.top))
    finally:
        writer.close()
    if done == 0:
        raise ConfigError(f"none of the {len(refs)} image(s) could be read (each is named above); give readable images")
    return done, skipped, model
