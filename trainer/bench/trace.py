"""Why DDP on seednet loses time at batch 64: per DDP variant, the step time and, from a profiler
trace of two steps, how much of the NCCL kernels' time ran while compute kernels ran too.

    torchrun --nproc-per-node 2 -m trainer.bench.trace
Eager mode (no torch.compile), so the variants differ only in how gradients travel.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from trainer.bench.micro import emit, timed
from trainer.metrics import merged
from trainer.models import seednet

VARIANTS = {
    "ddp": {},
    "ddp-bucket200-static": {"bucket_cap_mb": 200, "static_graph": True},
    "ddp-bf16-hook": {"hook": True},
}


def overlap(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in cover)


def main() -> None:
    dist.init_process_group("nccl")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.manual_seed(0)
    x = torch.randn(64, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (64,), device="cuda")
    for name, opts in VARIANTS.items():
        model = seednet().cuda().to(memory_format=torch.channels_last)
        hook = opts.pop("hook", False)
        net = nn.parallel.DistributedDataParallel(model, device_ids=[local], gradient_as_bucket_view=True, **opts)
        if hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            net.register_comm_hook(None, default_hooks.bf16_compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)

        def step(net=net, opt=opt):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        ms = timed(step, reps=20, warmup=5) * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        comm = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
        compute = merged([(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()])
        comm_us = sum(b - a for a, b in comm)
        busy_us = sum(b - a for a, b in compute)
        if dist.get_rank() == 0:
            emit({"run": f"trace-{name}", "step_ms": ms, "images_per_s": 128 / ms * 1e3, "compute_ms_per_step": busy_us / 2e3,
                  "nccl_ms_per_step": comm_us / 2e3, "nccl_overlapped_share": overlap(comm, compute) / comm_us if comm_us else None})
        del step, net, model, opt
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
