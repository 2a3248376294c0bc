"""Run under torchrun by tests/test_runtime.py: train with the real Trainer, then compare every rank's
parameters and write rank 0's as a flat vector. Usage: torchrun ... tests/ddp_probe.py OUT key=value..."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from trainer.config_loader import load_config
from trainer.worker.loop import Trainer
from trainer.worker.run import build
from trainer.worker.runtime import setup, teardown


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    # float64 throughout: one process and two sum gradients in another order, and float32's
    # rounding of that differs between CPUs (AVX2, AVX-512); float64's stays far below the tolerance
    torch.set_default_dtype(torch.float64)
    cfg = load_config(None, overrides)
    rt = setup(cfg)
    run = build(cfg, rt)
    Trainer(run).fit()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in run.model.parameters()]  # fsdp: gather shards
    flat = torch.cat([p.detach().reshape(-1) for p in full])
    gathered = [torch.empty_like(flat) for _ in range(rt.world_size)]
    if rt.distributed:
        dist.all_gather(gathered, flat)
    else:
        gathered = [flat]
    if rt.is_main:
        diff = max((g - flat).abs().max().item() for g in gathered)
        torch.save({"flat": flat, "max_rank_diff": diff}, out)
    teardown()


if __name__ == "__main__":
    main()
