"""Ceilings measured on the machine itself: bf16 matrix-product rate, all-reduce bandwidth, the
checkpoint stall of an asynchronous save against a synchronous one in the same run, and a restore.

    python -m bench.micro matmul
    torchrun --nproc-per-node 2 -m bench.micro allreduce
    python -m bench.micro stall key=value...        # seednet by default
    python -m bench.micro restore CONFIG key=value... # a restore's seconds and where they go
    python -m bench.micro augment                   # the input pipeline's GPU time
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
    if os.environ.get("BENCH_OUT"):
        with open(os.environ["BENCH_OUT"], "a") as fh:
            fh.write(json.dumps(record) + "\n")


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def matmul(n: int = 8192) -> None:
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    s = timed(lambda: x @ y, reps=20)
    emit({"run": "matmul-bf16", "n": n, "tflops": 2 * n**3 / s / 1e12})


def allreduce() -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    for dtype, numel in ((torch.float32, 604_137_986), (torch.bfloat16, 604_137_986), (torch.float32, 25 * 2**20 // 4)):
        t = torch.randn(numel, device="cuda", dtype=dtype)
        s = timed(lambda t=t: dist.all_reduce(t), reps=10)
        size = numel * t.element_size()
        if rank == 0:
            emit(
                {
                    "run": "allreduce",
                    "dtype": str(dtype).split(".")[-1],
                    "bytes": size,
                    "ms": s * 1e3,
                    "algbw_GBps": size / s / 1e9,
                    "busbw_GBps": size / s / 1e9 * 2 * (world - 1) / world,
                }
            )
    dist.destroy_process_group()


def started(args: list[str], name: str):
    """A run of ``args`` (a config file first, default configs/seed.yaml, then overrides) on
    synthetic data, started (warmed up) with its checkpoints in a fresh folder: (config, run,
    trainer, config file)."""
    from trainer.config_loader import load_config
    from trainer.worker.loop import Trainer
    from trainer.worker.run import build
    from trainer.worker.runtime import setup

    config = args[0] if args and args[0].endswith(".yaml") else "configs/seed.yaml"
    overrides = args[1:] if args and args[0].endswith(".yaml") else args
    folder = tempfile.mkdtemp(prefix=f"{name}-", dir=os.environ.get("BENCH_TMP"))
    cfg = load_config(
        config,
        [
            "data.name=synthetic",
            "data.synthetic_train_size=4096",
            "checkpoint.every_epochs=0",
            f"checkpoint.dir={folder}",
            "checkpoint.async_save=true",
            "train.plot=false",
            *overrides,
        ],
    )
    run = build(cfg, setup(cfg))
    trainer = Trainer(run)
    trainer.start()
    return cfg, run, trainer, config


def newest_bytes(root: Path) -> tuple[Path, int]:
    """The newest step-N folder (any checkpoint format) and the bytes of its files."""
    newest = max(root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return newest, sum(f.stat().st_size for f in newest.iterdir() if f.is_file())


def stall(args: list[str]) -> None:
    """Seconds that training stands still for an async save and for a sync save of the same state
    (the sync save waits for the async one first). ``args``: a config file, then overrides."""
    cfg, run, trainer, config = started(args, "stall")
    batches = run.loader.epoch(0)

    def steps(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            x, y, _ = next(batches)
            trainer.train_step(x, y)
            run.state.step += 1
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    base = steps(10)
    trainer.reserve()
    t0 = time.perf_counter()
    trainer.save()
    async_stall = time.perf_counter() - t0
    during = steps(10)  # the write goes on in the background meanwhile
    t0 = time.perf_counter()
    trainer.save(sync=True)
    sync_stall = time.perf_counter() - t0
    _, state_bytes = newest_bytes(Path(cfg.checkpoint.dir))  # what a save writes
    emit(
        {
            "run": "checkpoint-stall",
            "config": config,
            "model": cfg.model.name,
            "state_GB": state_bytes / 1e9,
            "async_stall_s": async_stall,
            "sync_stall_s": sync_stall,
            "step_ms": base * 1e3,
            "step_ms_during_write": during * 1e3,
        }
    )


def restore(args: list[str], reps: int = 3) -> None:
    """Seconds of a restore (the checkpoint into the live run: what a resumed start spends in its
    ``restore`` phase), ``reps`` times from one checkpoint of two steps in a page-cached folder;
    the last one's 20 costliest calls (cProfile, cumulative) go to stdout. Runs on the CPU too.
    ``args``: a config file, then overrides."""
    import cProfile
    import pstats

    cfg, run, trainer, config = started(args, "restore")
    batches = run.loader.epoch(0)
    for _step in range(2):  # a step or two, so that the optimizer's state exists
        x, y, _ = next(batches)
        trainer.train_step(x, y)
        run.state.step += 1
    trainer.save(sync=True)
    path, state_bytes = newest_bytes(Path(cfg.checkpoint.dir))
    sync = torch.cuda.synchronize if run.rt.cuda else (lambda: None)
    seconds = []
    for _ in range(reps):
        profile = cProfile.Profile()
        sync()
        t0 = time.perf_counter()
        with profile:
            run.checkpointer.restore(path)
            sync()
        seconds.append(time.perf_counter() - t0)
    shutil.rmtree(cfg.checkpoint.dir, ignore_errors=True)
    pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(20)
    emit(
        {
            "run": "checkpoint-restore",
            "config": config,
            "model": cfg.model.name,
            "state_GB": state_bytes / 1e9,
            "restore_s": [round(s, 4) for s in seconds],
        }
    )


def augment() -> None:
    """GPU time of augmenting a whole CIFAR-sized epoch at once (the device loader's work per
    epoch), and of one 512-image step, for both crop modes."""
    from trainer.config_loader import load_config
    from trainer.worker.data.loader import Augment
    from trainer.worker.runtime import Runtime

    rt = Runtime("single", 0, 0, 1, 1, torch.device("cuda"), None)
    images = torch.randint(0, 256, (50_000, 3, 32, 32), dtype=torch.uint8, device="cuda")
    idx = torch.arange(49_664, device="cuda")  # 97 steps of 512
    for mode, pad in (("zeros", 4), ("reflect", 2)):  # the default recipe's crop and the speed recipe's
        cfg = load_config(None, [f"data.crop_mode={mode}", f"data.crop_padding={pad}"])
        aug = Augment(cfg, rt, channels_last=True, per_rank_batch=512, steps_per_epoch=97)
        epoch = timed(lambda aug=aug: aug.train(images[idx], 0, 0, idx), reps=10)
        step = timed(lambda aug=aug: aug.train(images[idx[:512]], 0, 5, idx[:512]), reps=20)
        emit({"run": f"augment-{mode}", "epoch_ms": epoch * 1e3, "step_512_ms": step * 1e3, "images": len(idx)})


if __name__ == "__main__":
    what = sys.argv[1]
    {
        "matmul": matmul,
        "allreduce": allreduce,
        "stall": lambda: stall(sys.argv[2:]),
        "restore": lambda: restore(sys.argv[2:]),
        "augment": augment,
    }[what]()
