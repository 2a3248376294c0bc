"""trainer predict and trainer export, timed as a user runs them (BENCHMARKS.md, "Predict and export").

    python -m bench.predict OUT --cifar DIR [--images 10240] [--batch 256] [--workers 8] [--before TREE]
    [--predict-only] [--runtime-batch 32]

Makes ``--images`` photo-like JPEGs (500x375, about 100 KB: bench/data.py's) from the CIFAR-10
tarballs in DIR, and a ResNet-50 with random weights as a safetensors export (real ImageNet weights
cannot be downloaded on these machines; the speed is the same). Then, each as a whole command:

- ``trainer predict`` on the folder, and a plain torchvision script beside it (ImageFolder with
  Resize and CenterCrop, a DataLoader with the same batch and workers, ``model.eval()``): images/s;
  with ``--before TREE`` (a copy of an earlier commit's tree), that tree's ``trainer predict`` too,
  the three taking turns;
- ``trainer export`` to ONNX and to .pt2: seconds;
- onnxruntime's CPU images/s beside PyTorch's on the CPU (batch 32, every core).

One JSON line per case on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PLAIN = r"""
import sys, time, torch, torchvision
from torchvision import transforms as T
from safetensors.torch import load_file
root, weights, batch, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(mean, std)])
data = torchvision.datasets.ImageFolder(root, tf)
loader = torch.utils.data.DataLoader(data, batch_size=batch, num_workers=workers, pin_memory=True)
model = torchvision.models.resnet50(num_classes=10)
model.load_state_dict(load_file(weights))
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = model.to(dev).eval()
top = []
with torch.no_grad():
    for x, _ in loader:
        top.append(model(x.to(dev, non_blocking=True)).softmax(1).topk(5).indices.cpu())
print(sum(len(t) for t in top))
"""


def timed(cmd: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... exited {p.returncode}: {p.stderr[-2000:]}")
    return took, p


def make_model(out: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from trainer.worker import models
    from trainer.worker.data import IMAGENET_MEAN, IMAGENET_STD
    from trainer.worker.trained import Trained

    torch.manual_seed(0)
    model = models.build("resnet50", 10, 224).eval()
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    t = Trained("resnet50", classes, 224, IMAGENET_MEAN, IMAGENET_STD, out / "resnet50.safetensors", module=model)
    save_file(model.state_dict(), str(out / "resnet50.safetensors"))
    (out / "resnet50.json").write_text(json.dumps(t.about()))
    return out / "resnet50.safetensors"


def runtime_rates(onnx_file: Path, batch: int = 32, repeat: int = 5) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch

    from trainer.worker.trained import open_trained

    x = np.random.default_rng(0).normal(size=(batch, 3, 224, 224)).astype(np.float32)
    s = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    name = s.get_inputs()[0].name
    s.run(None, {name: x})
    t0 = time.perf_counter()
    for _ in range(repeat):
        s.run(None, {name: x})
    ort_rate = batch * repeat / (time.perf_counter() - t0)
    model = open_trained(str(onnx_file.with_suffix(".safetensors"))).module
    with torch.no_grad():
        model(torch.from_numpy(x))
        t0 = time.perf_counter()
        for _ in range(repeat):
            model(torch.from_numpy(x))
    return {
        "case": "cpu runtimes, resnet50 224 px",
        "batch": batch,
        "threads": torch.get_num_threads(),
        "onnxruntime_images_per_s": round(ort_rate, 1),
        "pytorch_images_per_s": round(batch * repeat / (time.perf_counter() - t0), 1),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--cifar", type=Path, required=True)
    p.add_argument("--images", type=int, default=10240)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--before", type=Path, help="an earlier commit's tree: its trainer predict timed beside")
    p.add_argument("--predict-only", action="store_true", help="no export and runtime cases")
    p.add_argument("--runtime-batch", type=int, default=32, help="the CPU runtimes' batch")
    a = p.parse_args(argv)
    a.out = a.out.resolve()
    from bench.data import make_set

    a.out.mkdir(parents=True, exist_ok=True)
    photos = a.out / "photo"
    if not (photos / "train").is_dir():
        make_set(a.cifar, photos, a.images, test=16, photo="photo")
    weights = make_model(a.out)
    folder = photos / "train"
    n = sum(1 for _ in folder.rglob("*.jpg"))
    trainer = [sys.executable, "-m", "trainer"]
    # Python's bytecode cache where the installed one cannot be written (a read-only or --no-compile
    # install: every command then compiled torch's imports, 11 s on the GPU host), as a pip-installed
    # venv has it; written once here, before the clock, for both scripts' imports.
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPYCACHEPREFIX": os.environ.get("PYTHONPYCACHEPREFIX", str(a.out / "pycache")),
    }
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    timed(
        [sys.executable, "-c", "import torch, torchvision, safetensors.torch, trainer.cli, trainer.worker.predict"],
        env=env,
    )
    cases = ["plain", "predict"] + (["before"] if a.before else [])
    for case in cases * 2:  # each twice, taking turns: the page cache warm for all
        if case == "plain":
            took, q = timed(
                [sys.executable, "-c", PLAIN, str(folder), str(weights), str(a.batch), str(a.workers)], env=env
            )
            assert q.stdout.strip() == str(n), q.stdout
        else:
            tree = a.before.resolve() if case == "before" else Path.cwd()
            took, q = timed(
                [
                    *trainer,
                    "predict",
                    str(weights),
                    str(folder),
                    "--batch-size",
                    str(a.batch),
                    "-q",
                    "--out",
                    str(a.out / "p.jsonl"),
                ],
                env={**env, "PYTHONPATH": os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])},
                cwd=tree,
            )
            assert f"{n} image(s) predicted" in q.stderr, q.stderr
        print(
            json.dumps(
                {
                    "case": f"{case}, resnet50 224 px, photo-like JPEGs",
                    "images": n,
                    "batch": a.batch,
                    "workers": a.workers,
                    "seconds": round(took, 2),
                    "images_per_s": round(n / took, 1),
                }
            ),
            flush=True,
        )
    if a.predict_only:
        return 0
    for fmt in ("onnx", "pt2"):
        took, q = timed(
            [*trainer, "export", str(weights), "--format", fmt, "--out", str(a.out / f"resnet50.{fmt}")], env=env
        )
        print(
            json.dumps(
                {
                    "case": f"export {fmt}, resnet50",
                    "command_s": round(took, 2),
                    "line": q.stderr.strip().splitlines()[-1],
                }
            ),
            flush=True,
        )
    print(json.dumps(runtime_rates(a.out / "resnet50.onnx", a.runtime_batch)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
