"""``trainer bench --suite data``: ResNet-50 at 224 px (bf16, channels-last, compiled, batch 256, one
GPU) fed three ways in one call: synthetic images already on the GPU (the ceiling), JPEG shards
streamed and decoded on the GPU (this trainer), and torchvision's reference loader (ImageFolder,
PIL RandomResizedCrop and flip, a DataLoader with a worker per core, pinned memory).

There is no large image set offline: the set is CIFAR-10's JPEGs upscaled and re-encoded (quality
90), made here from the tarballs in ``--cifar``: 256 px squares of 12 KB, or with ``--photo``
500x375 images with added grain, about 100 KB each, the size and decode cost of a photo. Each feed
is also timed alone (the loader, no model: batches on the GPU), its capacity where the GPU would
take more. Host memory: the streamed run again over an index that lists every shard 16 times (16x
the images, the same files), peak RSS of each.

    python -m bench.data OUT --cifar DIR [--photo [large]] [--images 25600] [--steps 100]
    python -m bench.data --readers SHARDS     # the two readers on the CPU
    python -m bench.data --memory SHARDS      # host memory of a streamed CPU run, the set x1 and x16
    python -m bench.data --decode CIFAR_DIR   # the GPU decode's parts on photo-like JPEGs, ms per batch of 256
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from multiprocessing import Pool
from pathlib import Path

# photo-like sizes (width, height): a camera's 4:3; "large" is scaled by the shard writer to 512 px (its shorter side)
PHOTO = {"photo": (500, 375), "large": (1333, 1000)}
MODEL = [
    "model.name=resnet50",
    "data.image_size=224",
    "train.batch_size=256",
    "train.epochs=2",
    "train.log_every=5",
    "train.plot=false",
    "train.tensorboard=false",
    "checkpoint.every_epochs=0",
    "optim.lr=0.1",
    "data.eval_batch_size=256",
]


def _upscale(item: tuple[str, bytes, str, bool]) -> None:
    import io

    import numpy as np
    from PIL import Image

    name, raw, out, photo = item
    w, h = PHOTO[photo] if photo else (256, 256)
    img = Image.open(io.BytesIO(raw)).convert("RGB").resize((w, h), Image.BICUBIC)
    if photo:  # grain: a smooth upscale compresses to a fifth of a photo's bytes and decodes faster
        grain = np.random.default_rng(abs(hash(name)) % 2**32).normal(0, 20, (h, w, 3))
        img = Image.fromarray((np.asarray(img) + grain).clip(0, 255).astype(np.uint8))
    img.save(out, format="JPEG", quality=90)


def make_set(cifar: Path, root: Path, images: int, test: int = 1024, photo: str = "") -> None:
    """CIFAR-10's first ``images`` train and ``test`` test JPEGs (round robin over classes), upscaled to
    256 px (or photo-like, see the module's docstring). Each tarball is read once, in order: a member taken out of a
    gzip stream out of order
    decompresses it again from the start (a 20,000-image set took minutes that way)."""
    jobs = []
    for split, n in (("train", images), ("test", test)):
        by_class: dict[str, list] = {}
        with tarfile.open(next(cifar.glob(f"*{split}*.tar.gz")), "r|gz") as tar:
            for m in tar:
                if m.isfile() and m.name.endswith(".jpg"):
                    by_class.setdefault(Path(m.name).parts[-2], []).append((m.name, tar.extractfile(m).read()))
        picked = [
            by_class[c][i] for i in range(n // len(by_class) + 1) for c in sorted(by_class) if i < len(by_class[c])
        ][:n]
        for name, raw in picked:
            out = root / split / Path(name).parts[-2] / Path(name).name
            out.parent.mkdir(parents=True, exist_ok=True)
            jobs.append((name, raw, str(out), photo))
    with Pool(os.cpu_count()) as pool:
        pool.map(_upscale, jobs, chunksize=256)


def times16(shards: Path, out: Path) -> None:
    """A shard folder with 16x the training images of ``shards``: its index lists every shard 16
    times (links to the same files), so the set grows without the disk."""
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((shards / "train.json").read_text())
    rows, n = np.load(shards / "train.offsets.npy"), len(index["shardlist"])
    copies = []
    for k in range(16):
        r = rows.copy()
        r["shard"] += k * n
        copies.append(r)
    np.save(out / "train.offsets.npy", np.concatenate(copies))
    (out / "train.json").write_text(
        json.dumps(dict(index, images=index["images"] * 16, shardlist=index["shardlist"] * 16))
    )
    for f in shards.iterdir():
        if f.suffix == ".tar" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
        elif f.name.startswith("test."):
            (out / f.name).write_bytes(f.read_bytes())


def peak_memory(cmd: list[str]) -> dict:
    """Run ``cmd``; the peaks of its process tree's anonymous and file-backed resident memory
    (RssAnon and RssFile of /proc/PID/status, summed over the tree, sampled every 0.2 s), in MB."""
    import psutil

    def field(pid: int, name: str) -> float:
        try:
            with open(f"/proc/{pid}/status") as fh:
                return next((int(line.split()[1]) / 1024 for line in fh if line.startswith(name + ":")), 0.0)
        except OSError:
            return 0.0

    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root, anon, file = psutil.Process(p.pid), 0.0, 0.0
    while p.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        anon = max(anon, sum(field(q.pid, "RssAnon") for q in tree))
        file = max(file, sum(field(q.pid, "RssFile") for q in tree))
        time.sleep(0.2)
    err = p.stderr.read() if p.stderr else ""
    return {
        "rc": p.returncode,
        "peak_anonymous_MB": round(anon),
        "peak_file_backed_MB": round(file),
        "tail": err[-600:] if p.returncode else "",
    }


def memory(shards: Path, tmp: Path) -> list[dict]:
    """Host memory of a streamed CPU run (tinynet, 60 steps of 256, two workers) over ``shards`` and
    over 16x its images: flat when the streamed path's memory does not grow with the set."""
    times16(shards, tmp / "x16")
    rows = []
    for name, folder in (("x1", shards), ("x16", tmp / "x16")):
        # data.image_size=32: tinynet's size, whatever the shards' images are (the workers decode them whole)
        cmd = [
            sys.executable,
            "-m",
            "trainer",
            "train",
            "--config",
            "configs/smoke.yaml",
            "data.name=shards",
            f"data.dir={folder}",
            "data.image_size=32",
            "data.loader=stream",
            "train.max_steps=60",
            "train.batch_size=256",
            "data.stream_workers=2",
            f"checkpoint.dir={tmp / name}",
            "train.plot=false",
            "train.tensorboard=false",
        ]
        rows.append({"case": f"streamed-memory-{name}", **peak_memory(cmd)})
    return rows


def trainer_run(name: str, args: list[str], out: Path) -> dict:
    """One `trainer train` run of two epochs; the steady images/s of the second half of the second
    epoch (the workers' prefetched batches drawn, the model compiled), the data share of a step in
    the second epoch, and the peak RSS."""
    ck = out / f"ck-{name}"
    shutil.rmtree(ck, ignore_errors=True)  # a run of the same case before would be resumed, finished
    t0 = time.time()
    # a wrapper process, so that the peak RSS read is this run's (its largest process, workers included)
    wrap = (
        "import resource,subprocess,sys; subprocess.run(sys.argv[1:]); "
        "print('RSS_MB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
    )
    p = subprocess.run(
        [sys.executable, "-c", wrap, sys.executable, "-m", "trainer", "train", *MODEL, f"checkpoint.dir={ck}", *args],
        capture_output=True,
        text=True,
    )
    (out / f"{name}.log").write_text(p.stdout + p.stderr)
    rows = (
        [json.loads(line) for line in (ck / "metrics.jsonl").read_text().splitlines()]
        if (ck / "metrics.jsonl").exists()
        else []
    )
    logs = [r for r in rows if r.get("event") == "log" and r.get("epoch") == 1]
    logs = logs[len(logs) // 2 :]  # an epoch starts on up to workers x 2 batches read ahead: not the steady pace
    rate = (logs[-1]["step"] - logs[0]["step"]) * 256 / (logs[-1]["time"] - logs[0]["time"]) if len(logs) > 1 else None
    epoch = next((r for r in rows if r.get("event") == "epoch" and r.get("epoch") == 1), {})
    share = (
        epoch.get("data_ms_per_step", 0)
        / max(1e-9, epoch.get("data_ms_per_step", 0) + epoch.get("step_ms_per_step", 0))
        if epoch
        else None
    )
    return {
        "case": name,
        "rc": p.returncode,
        "images_per_s": round(rate) if rate else None,
        "data_share": share,
        "max_rss_MB": float(p.stdout.split("RSS_MB")[-1]) if "RSS_MB" in p.stdout else None,
        "wall_s": round(time.time() - t0, 1),
        "tail": (p.stdout + p.stderr)[-600:] if p.returncode else "",
    }


def reference_loader(root: Path):
    """torchvision's reference recipe's training loader (ImageFolder, PIL RandomResizedCrop and
    flip, a worker per core but one, pinned memory) at batch 256, and its worker count."""
    import torch
    import torchvision
    from torchvision import transforms as T

    tf = T.Compose(
        [
            T.RandomResizedCrop(224),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    workers = len(os.sched_getaffinity(0)) - 1
    loader = torch.utils.data.DataLoader(
        torchvision.datasets.ImageFolder(str(root / "train"), tf),
        batch_size=256,
        shuffle=True,
        num_workers=workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
        prefetch_factor=4,
    )
    return loader, workers


def reference(root: Path, steps: int) -> dict:
    """torchvision's reference recipe's loader feeding the same compiled bf16 channels-last step."""
    import torch
    import torchvision

    loader, workers = reference_loader(root)
    model = torchvision.models.resnet50(num_classes=10).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    step = torch.compile(lambda x, y: torch.nn.functional.cross_entropy(model(x), y))

    def batches():
        while True:
            yield from loader

    # steady: after the batches the workers read ahead while the model compiled (workers x 4)
    skip = workers * 4 + 10
    it, times = batches(), []
    for i in range(skip + steps):
        x, y = next(it)
        x, y = x.cuda(non_blocking=True).contiguous(memory_format=torch.channels_last), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= skip and i % 10 == 0:
            torch.cuda.synchronize()
            times.append(time.perf_counter())
    rate = 10 * 256 * (len(times) - 1) / (times[-1] - times[0])
    return {"case": "reference-loader", "images_per_s": round(rate), "workers": workers}


def loader_alone(shards: Path, root: Path, steps: int) -> list[dict]:
    """Each feed without the model: batches of 256 on the GPU, normalised float (ours: CPU workers
    and GPU decode; the reference: its DataLoader's tensors copied over). Steady images/s: past the batches read ahead,
    then ten
    more."""
    import torch

    from trainer.config_loader import load_config
    from trainer.worker.data.loader import Augment
    from trainer.worker.data.stream import Streamed, StreamLoader
    from trainer.worker.runtime import setup, teardown

    def rate(batches, ahead: int) -> float:
        """Images/s after the ``ahead`` batches the workers read before the first was asked for."""
        times = []
        for i, _x in zip(range(ahead + 10 + steps), batches, strict=False):
            if i >= ahead + 10 and i % 10 == 0:
                torch.cuda.synchronize()
                times.append(time.perf_counter())
        return 10 * 256 * (len(times) - 1) / (times[-1] - times[0])

    rows = []
    for decode in ("cpu", "gpu"):
        cfg = load_config(
            None,
            [
                "data.name=shards",
                f"data.dir={shards}",
                "data.image_size=224",
                "train.batch_size=256",
                f"data.decode={decode}",
                "train.strategy=single",
                "checkpoint.dir=/tmp/unused",
            ],
        )
        rt = setup(cfg)
        try:
            loader = StreamLoader(
                Streamed(shards, "train"), cfg, rt, 256, Augment(cfg, rt, True, 256, 1), decode == "gpu"
            )
            batches = (x for e in range(1000) for x, _, _ in loader.epoch(e))
            rows.append(
                {
                    "case": f"ours-{decode}-decode-loader-alone",
                    "images_per_s": round(rate(batches, 2 * loader.loader_args["num_workers"])),
                    "workers": loader.loader_args["num_workers"],
                }
            )
        finally:
            teardown()
    loader, workers = reference_loader(root)
    batches = (x.cuda(non_blocking=True) for _ in range(1000) for x, _ in loader)
    rows.append(
        {"case": "reference-loader-alone", "images_per_s": round(rate(batches, 4 * workers)), "workers": workers}
    )
    return rows


def main(argv: list[str]) -> int:
    if argv[:1] == ["--decode"]:
        for r in decode_parts(Path(argv[1])):
            print(json.dumps(r), flush=True)
        return 0
    if argv[:1] in (["--readers"], ["--memory"]):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            return report(readers(Path(argv[1])) if argv[0] == "--readers" else memory(Path(argv[1]), Path(tmp)))
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--cifar", type=Path, required=True)
    p.add_argument("--images", type=int, default=25600)
    p.add_argument("--steps", type=int, default=100, help="the reference loader's timed steps")
    p.add_argument(
        "--photo",
        nargs="?",
        const="photo",
        default="",
        choices=sorted(PHOTO),
        help="photo-like images: 500x375 of about 100 KB, or --photo large: 1333x1000 (default: 256 px, 12 KB)",
    )
    p.add_argument(
        "--cases", default="", help="some cases, comma-separated (loader-alone: the three feeds without the model)"
    )
    a = p.parse_args(argv)
    return report(run(a.out, a.cifar, a.images, a.steps, a.photo, tuple(filter(None, a.cases.split(",")))))


def report(rows) -> int:
    """The rows as JSON lines, or none of them where a measured run failed: then one line naming
    it, its exit code and its error, and exit 1 (a failed run's figures measure nothing)."""
    rows = list(rows)
    failed = [r for r in rows if r.get("rc")]
    for r in failed:
        last = next((line for line in reversed(r.get("tail", "").splitlines()) if line.strip()), "no output")
        print(f"bench: {r['case']} failed (exit {r['rc']}): {last.strip()}; no figures reported", file=sys.stderr)
    if failed:
        return 1
    for r in rows:
        print(json.dumps(r), flush=True)
    return 0


def run(
    out: Path, cifar: Path, images: int = 25600, steps: int = 100, photo: str = "", only: tuple[str, ...] = ()
) -> list[dict]:
    """Every case of the suite (or those named in ``only``); the rows, also written to OUT/data-bench.json."""
    a = argparse.Namespace(out=out, cifar=cifar, images=images, steps=steps)
    a.out.mkdir(parents=True, exist_ok=True)
    root, shards = a.out / (photo or "jpeg256"), a.out / (f"shards-{photo}" if photo else "shards")
    t0 = time.time()
    if not (root / "test").is_dir():
        make_set(a.cifar, root, a.images, photo=photo)
    made = time.time() - t0
    if not (shards / "train.json").exists():  # a later call on the same OUT (other cases, cores) reuses them
        subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer",
                "data",
                "--shards",
                str(shards),
                "data.name=imagefolder",
                f"data.dir={root}",
            ],
            check=True,
        )
    sized = json.loads((shards / "train.json").read_text())
    times16(shards, a.out / "x16")
    steps = []  # two epochs of the set
    rows = [
        {
            "case": "set",
            "photo": photo,
            "images": a.images,
            "made_s": round(made, 1),
            "shard_bytes": sum(s["filesize"] for s in sized["shardlist"]),
        }
    ]
    cases = [
        ("ours-shards-cpu-decode", ["data.name=shards", f"data.dir={shards}", "data.loader=stream", *steps]),
        (
            "ours-shards-gpu-decode",
            ["data.name=shards", f"data.dir={shards}", "data.loader=stream", "data.decode=gpu", *steps],
        ),
        # the ceiling: the same model on synthetic images already on the GPU (a small set: only the step is timed)
        (
            "ceiling-synthetic-on-gpu",
            ["data.name=synthetic", "data.synthetic_train_size=12800", "data.synthetic_test_size=256", *steps],
        ),
        ("ours-shards-x16", ["data.name=shards", f"data.dir={a.out / 'x16'}", "data.loader=stream", *steps]),
        (
            "ours-shards-x16-gpu-decode",
            ["data.name=shards", f"data.dir={a.out / 'x16'}", "data.loader=stream", "data.decode=gpu", *steps],
        ),
    ]
    for name, args in cases:
        if only and name not in only:
            continue
        rows.append(trainer_run(name, args, a.out))
        (a.out / "data-bench.json").write_text(json.dumps(rows, indent=1))
        print(json.dumps(rows[-1]), flush=True)
    if not only or "reference-loader" in only:
        rows.append(reference(root, a.steps))
        print(json.dumps(rows[-1]), flush=True)
    for row in loader_alone(shards, root, 60) if not only or "loader-alone" in only else []:
        rows.append(row)
        print(json.dumps(row), flush=True)
    (a.out / "data-bench.json").write_text(json.dumps(rows, indent=1))
    return rows


def readers(shards: Path, images: int = 20000) -> list[dict]:
    """The two readers of the same shards on the CPU, one process, JPEG decode included: webdataset's
    sequential pipeline (its shard order, a 1,000-image shuffle buffer) and this trainer's indexed
    reads in a whole-set permutation (wids' IndexedTarSamples). Images per second."""
    import webdataset as wds

    from trainer.worker.data.loader import epoch_order
    from trainer.worker.data.shards import ShardSet
    from trainer.worker.data.stream import decode_cpu, read

    urls = [str(shards / s["url"]) for s in json.loads((shards / "train.json").read_text())["shardlist"]]
    t0, n = time.perf_counter(), 0
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False).shuffle(1000):
        import torch

        decode_cpu(torch.frombuffer(bytearray(sample["jpg"]), dtype=torch.uint8))
        n += 1
        if n == images:
            break
    rows = [{"case": "webdataset-sequential", "images_per_s": round(n / (time.perf_counter() - t0))}]
    ds = ShardSet(shards, "train")
    order = epoch_order(len(ds), 0, 0)[:images].tolist()
    t0 = time.perf_counter()
    for k in range(0, images, 256):
        raws, _, _ = read(ds, order[k : k + 256])
        for raw in raws:
            decode_cpu(raw)
    rows.append({"case": "indexed-permutation", "images_per_s": round(images / (time.perf_counter() - t0))})
    return rows


def decode_parts(cifar: Path, n: int = 256, repeat: int = 10) -> list[dict]:
    """Milliseconds per batch of ``n`` photo-like JPEGs for each part of the GPU decode path and its
    alternatives: where the GPU path's time goes."""
    import tempfile

    import torch
    import torch.nn.functional as F
    import torchvision
    from torchvision.io import ImageReadMode, decode_jpeg

    from trainer.worker.data.stream import boxes, crop_batch, crop_resize, step_uniforms

    with tempfile.TemporaryDirectory() as tmp:
        make_set(cifar, Path(tmp), n, test=10, photo="photo")
        files = sorted(Path(tmp, "train").rglob("*.jpg"))[:n]
        raws = [torchvision.io.read_file(str(f)) for f in files]
    flat = torch.cat(raws)
    views = list(torch.split(flat, [r.numel() for r in raws]))
    u = step_uniforms(0, 0, 0, n)
    dev = torch.device("cuda")

    def ms(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
        return round((time.perf_counter() - t0) / repeat * 1000, 2)

    rows = [{"case": "set", "images": n, "mean_bytes": flat.numel() // n, "shape": list(decode_jpeg(raws[0]).shape)}]
    rows.append({"case": "gpu-decode-list", "ms": ms(lambda: decode_jpeg(raws, mode=ImageReadMode.RGB, device=dev))})
    rows.append(
        {
            "case": "gpu-decode-views-of-one-buffer",
            "ms": ms(lambda: decode_jpeg(views, mode=ImageReadMode.RGB, device=dev)),
        }
    )
    imgs = decode_jpeg(raws, mode=ImageReadMode.RGB, device=dev)
    at, mirror = boxes(imgs, 224, u, True)

    def per_image(im, box, flip):  # the crop each image had on the GPU before crop_batch
        x = F.interpolate(
            im[:, box[0] : box[0] + box[2], box[1] : box[1] + box[3]].unsqueeze(0).float(),
            size=(224, 224),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )[0]
        return x.flip(2) if flip else x

    rows.append(
        {
            "case": "gpu-crop-resize-per-image",
            "ms": ms(lambda: torch.stack([per_image(im, at[j], mirror[j]) for j, im in enumerate(imgs)])),
        }
    )
    rows.append({"case": "gpu-boxes", "ms": ms(lambda: boxes(imgs, 224, u, True))})

    def roi(dtype):
        x = torch.stack(imgs).to(dtype)
        b = torch.tensor(at, dtype=torch.float, device=dev)
        rois = torch.stack(
            [torch.arange(n, device=dev, dtype=torch.float), b[:, 1], b[:, 0], b[:, 1] + b[:, 3], b[:, 0] + b[:, 2]], 1
        )
        out = torchvision.ops.roi_align(x, rois.to(dtype), 224, 1.0, -1, True)
        m = torch.tensor(mirror, device=dev)
        return torch.where(m[:, None, None, None], out.flip(3), out)

    rows.append({"case": "gpu-roi-align-batch-float", "ms": ms(lambda: roi(torch.float))})
    rows.append({"case": "gpu-roi-align-batch-half", "ms": ms(lambda: roi(torch.half))})
    ref = torch.stack([per_image(im, at[j], mirror[j]) for j, im in enumerate(imgs)])
    rows.append({"case": "gpu-crop-batch", "ms": ms(lambda: crop_batch(imgs, at, mirror, 224))})
    views = [v.pin_memory() for v in views]
    rows.append(
        {"case": "gpu-decode-pinned-views", "ms": ms(lambda: decode_jpeg(views, mode=ImageReadMode.RGB, device=dev))}
    )
    rows += nvimgcodec_parts(flat, raws, u, imgs, ms)
    rows.append(
        {"case": "roi-vs-interpolate-mean-abs", "levels": round((roi(torch.float) - ref).abs().mean().item(), 3)}
    )
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    for r in raws[:64]:
        decode_jpeg(r, mode=ImageReadMode.RGB)
    rows.append({"case": "cpu-decode-one-core", "ms_per_image": round((time.perf_counter() - t0) / 64 * 1000, 2)})
    cpu = [decode_jpeg(r, mode=ImageReadMode.RGB) for r in raws[:64]]
    t0 = time.perf_counter()
    for j, im in enumerate(cpu):
        crop_resize(im, at[j], 224, mirror[j])
    rows.append({"case": "cpu-crop-resize-one-core", "ms_per_image": round((time.perf_counter() - t0) / 64 * 1000, 2)})
    return rows


def nvimgcodec_parts(flat, raws, u, imgs, ms) -> list[dict]:
    """nvImageCodec beside torchvision's nvjpeg: the decode alone and the whole batch (decode, crops),
    whole images or only each crop box (ROI), and how far its pixels are from nvjpeg's."""
    import torch
    from nvidia import nvimgcodec
    from torchvision.io import ImageReadMode, decode_jpeg

    from trainer.worker.data.stream import decode_nvimgcodec, decode_on_gpu, nvimgcodec_decoder

    dev, n = torch.device("cuda"), len(raws)
    lengths, labels, where = [r.numel() for r in raws], torch.zeros(n, dtype=torch.long), [f"s:{j}" for j in range(n)]
    pinned = flat.pin_memory()
    streams = [nvimgcodec.CodeStream(r.numpy()) for r in raws]
    dec = nvimgcodec_decoder(dev)
    rows = [{"case": "nvimgcodec-decode-only", "ms": ms(lambda: dec.decode(streams))}]
    for backend, kind in (
        ("hw", nvimgcodec.BackendKind.HW_GPU_ONLY),
        ("cuda", nvimgcodec.BackendKind.GPU_ONLY),
        ("hybrid", nvimgcodec.BackendKind.HYBRID_CPU_GPU),
    ):
        one = nvimgcodec.Decoder(backends=[nvimgcodec.Backend(kind)])
        rows.append({"case": f"nvimgcodec-decode-only-{backend}", "ms": ms(lambda one=one: one.decode(streams))})
    got = [torch.from_dlpack(im).permute(2, 0, 1) for im in dec.decode(streams)]
    ref = decode_jpeg(raws, mode=ImageReadMode.RGB, device=dev)
    diff = max((a.int() - b.int()).abs().max().item() for a, b in zip(got, ref, strict=True))
    rows.append({"case": "nvimgcodec-vs-nvjpeg-max-abs", "levels": diff})
    for name in ("nvjpeg", "nvimgcodec", "roi"):
        os.environ["TRAINER_GPU_DECODER"] = name
        fn = decode_on_gpu if name == "nvjpeg" else decode_nvimgcodec
        rows.append(
            {
                "case": f"batch-{name}-decode-and-crop",
                "ms": ms(lambda fn=fn: fn((pinned, lengths), labels.clone(), where, 224, dev, u, True)),
            }
        )
    os.environ.pop("TRAINER_GPU_DECODER")
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
