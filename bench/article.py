"""The article's training loop (the blog post the project grew from), reproduced as written, for timing.

Same network (its ``MyModule`` is our ``seednet``), fp32, a CPU DataLoader whose dataset returns
PIL images through ``ToTensor`` (as torchvision's CIFAR10 does), batch 64 per process, plain SGD at
lr 0.01, ``.cuda()`` copies and ``loss.item()`` every step. Synthetic images of CIFAR's shape stand
in for the download. The one change: it stops after ``--steps`` timed steps.

    python -m bench.article --mode single --steps 40
    python -m bench.article --mode dp --steps 40                   # DataParallel, all GPUs
    torchrun --nproc-per-node 2 -m bench.article --mode ddp --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torchvision
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from trainer.worker.data import synthetic
from trainer.worker.models import seednet


class SyntheticCIFAR(Dataset):
    """CIFAR10-like: uint8 HWC arrays, a PIL image per item, then the transform."""

    def __init__(self, n: int, transform):
        train, _ = synthetic(n, 1)
        self.data = train.images.permute(0, 2, 3, 1).contiguous().numpy()
        self.targets = train.labels.tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i):
        return self.transform(Image.fromarray(self.data[i])), self.targets[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["single", "dp", "ddp"], required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default="")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = p.parse_args()

    sampler, rank, world = None, 0, 1
    if args.mode == "ddp":
        torch.distributed.init_process_group("nccl")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        torch.cuda.set_device(args.local_rank)
    train_data = SyntheticCIFAR(64 * world * (args.steps + args.warmup + 2), torchvision.transforms.ToTensor())
    if args.mode == "ddp":
        sampler = DistributedSampler(train_data)
    train_dataloader = DataLoader(train_data, batch_size=64, sampler=sampler)

    my_module = seednet()
    if args.mode == "single":
        my_module.cuda()
    elif args.mode == "dp":
        my_module = nn.DataParallel(my_module.cuda(), device_ids=list(range(torch.cuda.device_count())))
    else:
        my_module = nn.parallel.DistributedDataParallel(my_module.cuda(args.local_rank), device_ids=[args.local_rank])
    loss_fn = nn.CrossEntropyLoss()
    optimize = torch.optim.SGD(my_module.parameters(), lr=0.01)

    train_step, t0, first = 0, None, None
    started = time.perf_counter()
    my_module.train()
    if sampler is not None:
        sampler.set_epoch(0)
    for imgs, targets in train_dataloader:
        device = args.local_rank if args.mode == "ddp" else None
        imgs, targets = imgs.cuda(device), targets.cuda(device)
        outputs = my_module(imgs)
        loss = loss_fn(outputs, targets)
        optimize.zero_grad()
        loss.backward()
        optimize.step()
        train_step += 1
        _ = loss.item()  # the article prints the loss every step: a CPU-GPU sync each time
        if train_step == 1:
            first = time.perf_counter() - started
        if train_step == args.warmup:
            t0 = time.perf_counter()
        if train_step == args.warmup + args.steps:
            break
    seconds = time.perf_counter() - t0
    images = args.steps * 64 * (world if args.mode == "ddp" else 1)
    gpus = {"ddp": world, "dp": torch.cuda.device_count()}.get(args.mode, 1)
    result = {
        "run": f"article-{args.mode}",
        "gpus": gpus,
        "batch_per_gpu": 64 / gpus if args.mode == "dp" else 64,
        "images_per_s": images / seconds,
        "first_step_s": first,
    }
    if rank == 0:
        print(json.dumps(result), flush=True)
        out = args.out or os.environ.get("BENCH_OUT")
        if out:
            with open(out, "a") as fh:
                fh.write(json.dumps(result) + "\n")
    if args.mode == "ddp":
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
