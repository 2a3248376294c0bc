"""``trainer bench`` (``make bench``): the article's loop beside this trainer, on the same model,
batch and GPUs, plus the machine's own ceilings. Runs on a GPU machine; every case is a separate
process (so one crash costs one row) and appends a JSON line to ``OUT/results.jsonl``; at the end a
table is printed and ``OUT/results.json`` and ``OUT/bench.png`` are written.

    trainer bench                                  # everything, on all visible GPUs
    trainer bench --suite article,seednet          # some suites
    trainer bench --suite recipes --data /path/to/cifar10
Suites:
    restart           command -> first step, cold on a fresh node, then warm from the volume (--configs)
    micro             bf16 matmul ceiling, all-reduce bandwidth
    article           the article's loop: one GPU, DataParallel, DDP
    seednet           our trainer on seednet, batch 64 to 512, one GPU, DDP and FSDP, the fast path off
    seednet-ablation  seednet's fast path with one part off at a time (one GPU, batch 64)
    seednet-weights   bf16 working weights under DDP, each way of moving gradients, beside the article's DDP
    stall             asynchronous against synchronous checkpoint
    recipes           the speed recipe (configs/fast.yaml) on real data
    ablation          the speed recipe with one switch off at a time
    seeds             the speed recipe on more seeds (--seeds)
    resnet18          the default recipe on real data, all GPUs; resnet18-scaling: one GPU, then all
    data              ResNet-50 at 224 px from JPEG shards, beside synthetic data on the GPU and the reference loader
Diagnoses that answered their question (DDP overlap traces, NCCL channels, profiles) are in git
history beside their figures in bench/results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.contract import COMMAND_START_ENV

SEEDNET_FLOP = 128.1e9  # per image per training step (6 x 21.35 G multiply-adds)
PLAIN = [
    "train.precision=fp32",
    "model.compile=false",
    "model.channels_last=false",
    "data.device_resident=false",
    "optim.impl=loop",
]


# Each row turns one part of configs/fast.yaml off (or one thing on), against the recipe as shipped
# (the recipes suite's fast-1gpu).
ABLATION = [
    ("random-flip", ["data.flip_mode=random"]),
    ("no-lookahead", ["optim.lookahead_every=0"]),
    ("eager", ["model.compile=false"]),
    ("no-cudagraphs", ["model.compile_mode=default"]),
    ("airbench-schedule", ["optim.warmup_epochs=2.0", "optim.final_lr_fraction=0"]),
]


# seednet's fast path with one part off at a time (one GPU, batch 64), against all of it on
# (ours-single-b64): what each part buys at the article's batch.
SEEDNET_ABLATION = [
    ("fp32", ["train.precision=fp32"]),
    ("no-channels-last", ["model.channels_last=false"]),
    ("eager", ["model.compile=false"]),
    ("host-loader", ["data.device_resident=false"]),
    ("foreach-sgd", ["optim.impl=foreach"]),
    ("loop-sgd", ["optim.impl=loop"]),
]


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (metrics.jsonl, results.jsonl); none where it is missing."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def cmd_for(gpus: int, module: str, args: list[str]) -> list[str]:
    if gpus == 1:
        return [sys.executable, "-m", module, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        "-m",
        module,
        *args,
    ]


def run_case(name: str, cmd: list[str], out: Path, timeout: int, env: dict | None = None) -> tuple[int, str]:
    t0 = time.time()
    # the cases' modules (bench.micro ...) are the repository's, not the installed package's
    path = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])
    )
    e = {**os.environ, "BENCH_OUT": str(out / "results.jsonl"), "PYTHONPATH": path, **(env or {})}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
        code, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as ex:
        code, text = 124, f"timeout after {timeout}s\n{ex.stdout or ''}{ex.stderr or ''}"
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / f"{name}.log").write_text(text if isinstance(text, str) else text.decode())
    print(f"[{time.strftime('%H:%M:%S')}] {name}: exit {code} in {time.time() - t0:.0f}s", flush=True)
    if code:
        print("   " + "\n   ".join(str(text).strip().splitlines()[-6:]), flush=True)
    return code, text


SHIPPED_CONFIGS = ("configs/default.yaml", "configs/fast.yaml", "configs/seed.yaml")
NODE_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "XDG_CACHE_HOME", COMMAND_START_ENV)


def evict_page_cache(*roots: Path) -> int:
    """Drop the kernel's cached pages of every file under ``roots`` (posix_fadvise DONTNEED; no root
    needed; pages still mapped by a live process stay, a tmpfs keeps its files): a start after it
    reads its libraries and checkpoint from disk, as on a fresh node, not from the memory of the
    start before. Returns the bytes of the files it asked the kernel to drop."""
    dropped = 0
    for root in roots:
        for f in [root] if root.is_file() else (p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return dropped


def node_files(volume: Path) -> list[Path]:
    """What a fresh node has not read yet: the interpreter's libraries (torch, Triton, the CUDA
    wheels: gigabytes) and the job's volume."""
    import sysconfig

    return [
        Path(sysconfig.get_paths()["stdlib"]),
        Path(sysconfig.get_paths()["purelib"]),
        Path(sysconfig.get_paths()["platlib"]),
        volume,
    ]


def restart_pair(
    tmp: Path,
    gpus: int,
    config: str,
    data: str,
    logs: Path | None = None,
    steps: int = 2,
    node_env: dict[str, dict[str, str]] | None = None,
) -> tuple[dict, dict]:
    """A start as a user feels it, from the `trainer launch` command to the first training step:
    cold (a fresh node: empty HOME and TMPDIR, so no inductor, Triton or CUDA caches; an empty
    volume), then warm (another fresh node, the same volume: the checkpoint and the compile cache).
    Before each start the page cache of the libraries and the volume is dropped: the warm start
    does not read them from the memory of the cold one, as no relaunch on a new node does.
    Returns (cold, warm): each its exit code and, when it trained, the `first_step` record's figures.
    ``node_env`` adds variables to the "cold" or "warm" start (TORCH_TRACE, say)."""
    name = "restart-" + Path(config).stem
    volume = tmp / name

    def start(node: str, max_steps: int) -> dict:
        home = tmp / f"{name}-{node}-home"
        (home / "tmp").mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k not in NODE_CACHES}
        env.update(HOME=str(home), TMPDIR=str(home / "tmp"), **(node_env or {}).get(node, {}))
        cmd = [
            sys.executable,
            "-m",
            "trainer",
            "launch",
            "--nproc-per-node",
            str(gpus),
            "--config",
            config,
            "data.name=imagefolder",
            f"data.dir={data}",
            f"data.cache_dir={volume / 'data-cache'}",
            f"checkpoint.dir={volume / 'ck'}",
            f"train.max_steps={max_steps}",
            "train.plot=false",
            "checkpoint.every_steps=1",
        ]
        evicted = evict_page_cache(*node_files(volume))  # a fresh node's page cache holds none of them
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"{name}-{node}.log").write_text(p.stdout + p.stderr)
        metrics = volume / "ck" / "metrics.jsonl"
        first = [r for r in read_jsonl(metrics) if r.get("event") == "first_step"]
        if p.returncode or not first:
            return {"exit": p.returncode, "output": "\n".join((p.stdout + p.stderr).strip().splitlines()[-30:])}
        f = first[-1]
        return {
            "exit": 0,
            "command_to_first_step_s": f.get("since_command_s") or round(f["time"] - t0, 3),
            "worker_first_step_s": f["seconds"],
            "wall_s": round(time.time() - t0, 1),
            "evicted_GB": round(evicted / 1e9, 2),
            **{k: f.get(k) for k in ("compile_cache", "startup_s", "compile_s", "graph_cache")},
        }

    try:
        cold = start("cold", steps)
        return cold, (start("warm", steps + 2) if cold["exit"] == 0 else {"exit": None})
    finally:
        shutil.rmtree(volume, ignore_errors=True)


@dataclass
class Bench:
    """What every suite needs: where results go, a scratch folder, the GPUs, the data, the options."""

    out: Path
    tmp: Path
    gpus: int
    data: str
    args: argparse.Namespace

    def append(self, record: dict) -> None:
        with open(self.out / "results.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def ours(self, name: str, gpus: int, batch_per_gpu: int, extra: list[str], steps: int = 60) -> None:
        """Our trainer on synthetic data; steady images/s from the log windows after the first."""
        ck = self.tmp / name
        args = [
            "train",
            "--config",
            "configs/seed.yaml",
            "data.name=synthetic",
            f"data.synthetic_train_size={max(4096, batch_per_gpu * gpus * (steps + 2))}",
            "data.synthetic_test_size=1000",
            f"train.batch_size={batch_per_gpu * gpus}",
            f"train.max_steps={steps}",
            "train.log_every=10",
            f"checkpoint.dir={ck}",
            "checkpoint.every_epochs=0",
            "train.plot=false",
            "train.epochs=1",
            *extra,
        ]
        code, _ = run_case(name, cmd_for(gpus, "trainer", args), self.out, timeout=240)
        rows = read_jsonl(ck / "metrics.jsonl")
        shutil.rmtree(ck, ignore_errors=True)  # 2.4 GB checkpoints in /dev/shm
        windows = [r["images_per_s"] for r in rows if r.get("event") == "log"][1:]
        first = next((r["seconds"] for r in rows if r.get("event") == "first_step"), None)
        self.append(
            {
                "run": name,
                "gpus": gpus,
                "batch_per_gpu": batch_per_gpu,
                "exit": code,
                "first_step_s": first,
                "images_per_s": statistics.median(windows) if windows else None,
                "windows": windows,
                "overrides": extra,
            }
        )

    def recipe(self, name: str, gpus: int, config: str, extra: list[str], target: float = 0.906) -> None:
        """Time to accuracy on real data: training seconds (compile and evaluation excluded)."""
        ck = self.tmp / name
        # a shared decode cache for benches run side by side
        cache = os.environ.get("BENCH_CACHE") or self.tmp / "cache"
        args = [
            "train",
            "--config",
            config,
            "data.name=imagefolder",
            f"data.dir={self.data}",
            f"data.cache_dir={cache}",
            f"checkpoint.dir={ck}",
            "train.plot=false",
            *extra,
        ]
        code, _ = run_case(name, cmd_for(gpus, "trainer", args), self.out, timeout=900)
        rows = read_jsonl(ck / "metrics.jsonl")
        if rows:
            shutil.copy(ck / "metrics.jsonl", self.out / "logs" / f"{name}.metrics.jsonl")
        shutil.rmtree(ck, ignore_errors=True)
        epochs = [r for r in rows if r.get("event") == "epoch"]
        elapsed, reached = 0.0, None
        for r in epochs:
            elapsed += r["train_seconds"]
            if reached is None and r.get("test_acc") is not None and r["test_acc"] >= target:
                reached = elapsed
        timed = [r for r in epochs if r.get("step_ms_per_step")]
        data_ms = sum(r["data_ms_per_step"] * r["steps"] for r in timed)
        step_ms = sum(r["step_ms_per_step"] * r["steps"] for r in timed)
        self.append(
            {
                "run": name,
                "gpus": gpus,
                "exit": code,
                "overrides": extra,
                "epochs": len(epochs),
                "train_seconds": round(elapsed, 3),
                "step_ms_per_epoch": [r.get("step_ms_per_step") for r in epochs],
                "final_test_acc": epochs[-1]["test_acc"] if epochs else None,
                "target": target,
                "seconds_to_target": reached,
                # all steps' data time / their step time
                "data_share_of_step": data_ms / step_ms if step_ms else None,
                "epoch_seconds": [r["train_seconds"] for r in epochs],
                "images_per_s": statistics.median([r["images_per_s"] for r in epochs]) if epochs else None,
                "first_step_s": next((r["seconds"] for r in rows if r.get("event") == "first_step"), None),
            }
        )

    def restart(self, config: str) -> None:
        """One row of the restart suite: cold and warm starts of ``config`` and their ratio."""
        name = "restart-" + Path(config).stem
        cold, warm = restart_pair(self.tmp, self.gpus, config, self.data, logs=self.out / "logs")
        for node, r in (("cold", cold), ("warm", warm)):
            if r.get("output"):
                tail = "\n   ".join(r.pop("output").splitlines()[-6:])
                print(f"   {name} {node}: exit {r['exit']}\n   {tail}", flush=True)
        ok = warm.get("exit") == 0
        ratio = round(warm["command_to_first_step_s"] / cold["command_to_first_step_s"], 3) if ok else None
        self.append(
            {"run": name, "gpus": self.gpus, "config": config, "cold": cold, "warm": warm, "warm_over_cold": ratio}
        )
        print(
            f"[{time.strftime('%H:%M:%S')}] {name}: cold {cold.get('command_to_first_step_s')} s, "
            f"warm {warm.get('command_to_first_step_s')} s, ratio {ratio}",
            flush=True,
        )

    def case(
        self, name: str, gpus: int, module: str, args: list[str], timeout: int = 600, env: dict | None = None
    ) -> None:
        run_case(name, cmd_for(gpus, module, args), self.out, timeout, env)


def _restart(b: Bench) -> None:
    for config in b.args.configs.split(","):
        b.restart(config)


def _micro(b: Bench) -> None:
    b.case("matmul", 1, "bench.micro", ["matmul"], 300)
    if b.gpus > 1:
        b.case("allreduce", b.gpus, "bench.micro", ["allreduce"], 300)


def _article(b: Bench) -> None:
    b.case("article-single", 1, "bench.article", ["--mode", "single"])
    if b.gpus > 1:
        b.case("article-dp", 1, "bench.article", ["--mode", "dp"])
        b.case("article-ddp", b.gpus, "bench.article", ["--mode", "ddp"])


def _seednet(b: Bench) -> None:
    b.ours("ours-single-b64-plain", 1, 64, PLAIN)
    for batch in (64, 256, 512):
        b.ours(f"ours-single-b{batch}", 1, batch, [], steps=60 if batch < 512 else 40)
    if b.gpus > 1:
        fsdp = ["train.strategy=fsdp", "dist.reduce_dtype=bf16"]
        for batch in (64, 256):
            b.ours(f"ours-ddp-b{batch}", b.gpus, batch, [])
            b.ours(f"ours-fsdp-b{batch}", b.gpus, batch, fsdp)
        b.ours("ours-fsdp-b512", b.gpus, 512, fsdp, steps=40)


def _stall(b: Bench) -> None:
    b.case("stall", 1, "bench.micro", ["stall", f"checkpoint.dir={b.tmp / 'stall'}"], env={"BENCH_TMP": str(b.tmp)})


def _recipes(b: Bench) -> None:
    b.recipe("fast-1gpu", 1, "configs/fast.yaml", [])
    if b.gpus > 1:
        b.recipe("fast-2gpu", b.gpus, "configs/fast.yaml", [])


def _ablation(b: Bench) -> None:
    for name, extra in ABLATION:
        b.recipe(f"fast-{name}", 1, "configs/fast.yaml", extra)


def _seeds(b: Bench) -> None:
    for seed in b.args.seeds:
        b.recipe(f"fast-seed{seed}", 1, "configs/fast.yaml", [f"train.seed={seed}"])


def _seednet_ablation(b: Bench) -> None:
    b.ours("ours-single-b64", 1, 64, [])
    for name, extra in SEEDNET_ABLATION:
        b.ours(f"ours-single-b64-{name}", 1, 64, extra)


def _resnet18(b: Bench) -> None:
    b.recipe("resnet18", b.gpus, "configs/default.yaml", [f"train.epochs={b.args.resnet_epochs}"])


def _resnet18_scaling(b: Bench) -> None:
    epochs = [f"train.epochs={b.args.resnet_epochs}"]
    b.recipe("resnet18-1gpu", 1, "configs/default.yaml", epochs)
    if b.gpus > 1:
        b.recipe(f"resnet18-{b.gpus}gpu", b.gpus, "configs/default.yaml", epochs)


def _seednet_weights(b: Bench) -> None:
    """bf16 working weights under DDP, each way of moving their gradients, beside the article's DDP
    loop of the same call: -after all-reduces every gradient, -gather computes the first Linear's
    from all-gathered factors (dist.gather_linear_factors)."""
    if b.gpus < 2:
        return
    b.case("article-ddp", b.gpus, "bench.article", ["--mode", "ddp"])
    bf16w = ["train.param_dtype=bf16"]
    ways = {"after": ["dist.gather_linear_factors=false"], "gather": ["dist.gather_linear_factors=auto"]}
    for batch, steps in ((64, 60), (512, 40)):
        for way, extra in ways.items():
            b.ours(f"ours-ddp-b{batch}-bf16w-{way}", b.gpus, batch, [*bf16w, *extra], steps=steps)
    b.ours("ours-ddp-b1024-bf16w-gather", b.gpus, 1024, [*bf16w, *ways["gather"]], steps=30)


def _data(b: Bench) -> None:
    """ResNet-50 at 224 px fed three ways (bench/data.py), its rows appended as they are."""
    from bench import data

    rows = data.run(b.out / "data", Path(b.data))
    for row in rows:
        b.append({"run": f"data-{row['case']}", **row})


SUITES = {
    "data": _data,
    "restart": _restart,
    "micro": _micro,
    "article": _article,
    "seednet": _seednet,
    "stall": _stall,
    "recipes": _recipes,
    "ablation": _ablation,
    "seeds": _seeds,
    "seednet-ablation": _seednet_ablation,
    "resnet18": _resnet18,
    "resnet18-scaling": _resnet18_scaling,
    "seednet-weights": _seednet_weights,
}


def table(rows: list[dict]) -> str:
    ceiling = next((r["tflops"] for r in rows if r.get("run") == "matmul-bf16"), None)
    singles = {
        r["batch_per_gpu"]: r["images_per_s"]
        for r in rows
        if r.get("run", "").startswith("ours-single-b") and "plain" not in r["run"] and r.get("images_per_s")
    }
    lines = [
        f"{'run':28} {'GPUs':>4} {'b/GPU':>6} {'images/s':>10} {'TFLOP/s/GPU':>12} {'of bf16 peak':>12} "
        f"{'scaling':>8} {'1st step s':>10}"
    ]
    for r in rows:
        ips = r.get("images_per_s")
        if ips is None or "batch_per_gpu" not in r:
            continue
        tf = ips / r["gpus"] * SEEDNET_FLOP / 1e12
        share = f"{100 * tf / ceiling:.0f}%" if ceiling else "-"
        base = singles.get(r["batch_per_gpu"])
        scaled = base and r["gpus"] > 1 and r["run"].startswith("ours")
        scale = f"{100 * ips / (r['gpus'] * base):.0f}%" if scaled else "-"
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") else "-"
        lines.append(
            f"{r['run']:28} {r['gpus']:>4} {r['batch_per_gpu']:>6g} {ips:>10,.0f} {tf:>12.1f} {share:>12} "
            f"{scale:>8} {first:>10}"
        )
    for r in rows:
        if r.get("run") == "checkpoint-stall":
            lines.append(
                f"checkpoint ({r['state_GB']:.2f} GB written): async stall {r['async_stall_s']:.3f}s, "
                f"sync save {r['sync_stall_s']:.2f}s, step {r['step_ms']:.1f} ms, "
                f"{r['step_ms_during_write']:.1f} ms while writing"
            )
        if "seconds_to_target" in r:
            acc = r.get("final_test_acc")
            to = r["seconds_to_target"]
            reached = "not reached" if to is None else f"reached after {to:.2f}s"
            lines.append(
                f"{r['run']}: failed"
                if acc is None
                else f"{r['run']}: {r['gpus']} GPU(s), test acc {100 * acc:.2f}% "
                f"after {r['train_seconds']:.2f}s of training; {r['target']:.1%} {reached}; "
                f"data {100 * r['data_share_of_step']:.1f}% of step time"
            )
        if r.get("run", "").startswith("restart-"):
            c, w = r["cold"], r["warm"]
            lines.append(
                f"{r['run']}: {r['gpus']} GPU(s), command -> first step "
                f"cold {c.get('command_to_first_step_s')} s "
                f"(worker {c.get('worker_first_step_s')}), warm {w.get('command_to_first_step_s')} s "
                f"(worker {w.get('worker_first_step_s')}), warm/cold {r['warm_over_cold']}"
            )
        if r.get("run") in ("matmul-bf16", "allreduce"):
            lines.append(json.dumps(r))
    return "\n".join(lines)


def chart(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(r["run"], r["images_per_s"]) for r in rows if r.get("images_per_s") and "batch_per_gpu" in r]
    if not bars:
        return
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(bars) + 1.5))
    colors = ["tab:gray" if n.startswith("article") else "tab:blue" for n, _ in bars]
    ax.barh([n for n, _ in bars], [v for _, v in bars], color=colors)
    for i, (_, v) in enumerate(bars):
        ax.text(v, i, f" {v:,.0f}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("images/s (seednet, synthetic CIFAR-shaped data)")
    ax.set_title("The article's loop (gray) and this trainer (blue)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="trainer bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench-results")
    p.add_argument(
        "--suite",
        default="micro,article,seednet,stall,recipes,resnet18",
        help=f"comma-separated, of: {', '.join(SUITES)}",
    )
    p.add_argument("--data", default="", help="CIFAR-10 image folders or tarballs for the recipes (default ./data)")
    p.add_argument(
        "--configs",
        default=",".join(SHIPPED_CONFIGS),
        help="restart: the configs to start (default: every shipped one)",
    )
    p.add_argument("--resnet-epochs", type=int, default=30)
    p.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 2, 3],
        help="seeds of the seeds suite, e.g. 4,5,6",
    )
    args = p.parse_args(argv)
    unknown = [s for s in args.suite.split(",") if s not in SUITES]
    if unknown:
        print(f"error: no suite {', '.join(unknown)}; pass --suite with some of {','.join(SUITES)}", file=sys.stderr)
        return 2
    import torch  # after the usage checks: seconds

    if not torch.cuda.is_available():
        print("error: trainer bench needs CUDA GPUs; run it on a host with CUDA GPUs", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    bench = Bench(out, tmp, torch.cuda.device_count(), args.data or "data", args)
    for suite in args.suite.split(","):
        SUITES[suite](bench)
    rows = read_jsonl(out / "results.jsonl")
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "command": "trainer bench " + " ".join(argv),
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    chart(rows, out / "bench.png")
    print(json.dumps(meta))
    print(table(rows))
    return 0
