"""Everything a run needs before its first step, built in the order that keeps resume correct:
checks (rank 0) -> data -> model -> checkpoint weights -> wrap -> optimizer -> optimizer state."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer import compile_cache, data, models, parallel
from trainer.checkpoint import Checkpointer, ModelPart, OptimizerPart, TrainState
from trainer.config import Config, ConfigError
from trainer.dist import Runtime, agree, broadcast
from trainer.loader import Augment, make_train_loader
from trainer.metrics import Progress, RunLog, Startup
from trainer.optim import Lookahead, MasterWeights, build_optimizer, build_schedule
from trainer.stop import StopFlag
from trainer.watchdog import Watchdog


@dataclass(frozen=True)
class Fast:
    """The fast path's switches as resolved for this process (auto = on for CUDA)."""

    bf16: bool
    channels_last: bool
    compile: bool
    device_resident: bool
    async_save: bool
    bf16_weights: bool = False
    compile_mode: str = "default"
    """model.compile_mode with auto resolved (see ModelConfig.compile_mode)."""

    @classmethod
    def resolve(cls, cfg: Config, rt: Runtime) -> Fast:
        def auto(value: bool | None) -> bool:
            return rt.cuda if value is None else value

        compile_model = auto(cfg.model.compile) and rt.strategy != "dp"
        bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and rt.cuda)
        if cfg.train.param_dtype == "bf16" and not bf16:
            raise ConfigError("train.param_dtype=bf16 needs bf16 autocast, which auto turns on only on GPUs; set train.precision=bf16 or train.param_dtype=fp32")
        bf16_weights = cfg.train.param_dtype == "bf16" or (cfg.train.param_dtype == "auto" and bf16 and cfg.bf16_weights_problem(rt.strategy) is None)
        if cfg.model.compile and rt.strategy == "dp":
            raise ConfigError("model.compile=true does not work with train.strategy=dp; use model.compile=false (or auto) or train.strategy=ddp")
        return cls(
            bf16=bf16,
            bf16_weights=bf16_weights,
            channels_last=auto(cfg.model.channels_last),
            compile=compile_model,
            device_resident=cfg.data.device_resident,
            async_save=auto(cfg.checkpoint.async_save),
            compile_mode=resolve_compile_mode(cfg.model.compile_mode, rt.strategy, rt.cuda),
        )

    @property
    def cudagraphs(self) -> bool:
        return self.compile and self.compile_mode in ("reduce-overhead", "max-autotune")

    def __str__(self) -> str:
        on = [f.name for f in fields(self) if f.name != "compile_mode" and getattr(self, f.name)]
        on = [f"compile ({self.compile_mode})" if name == "compile" else name for name in on]
        return "fast path: " + (", ".join(on) if on else "off")


def resolve_compile_mode(mode: str, strategy: str, cuda: bool) -> str:
    """auto: CUDA graphs (reduce-overhead) wherever a compiled GPU step can be captured; plain
    compilation on the CPU (no graphs there) and under fsdp (its hooks gather weights between graphs)."""
    if mode != "auto":
        return mode
    return "reduce-overhead" if cuda and strategy != "fsdp" else "default"


@dataclass
class Run:
    cfg: Config
    rt: Runtime
    fast: Fast
    root: Path
    state: TrainState
    train_split: data.Split
    test_split: data.Split
    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Any
    lookahead: Lookahead | None
    loader: Any
    augment: Augment
    steps_per_epoch: int
    total_steps: int
    stop: StopFlag
    checkpointer: Checkpointer
    metrics: RunLog
    """metrics.jsonl (and TensorBoard): one record per event; ``say`` prints."""
    say: Progress
    resumed_from: Path | None
    started_at: float
    startup: Startup
    """Start-up phases so far; the warm-up adds its own and logs them with the first step."""
    watchdog: Watchdog
    """Ends the attempt as a crash, stacks saved, when no step finishes for dist.hang_timeout_s."""
    compile_cache: str = "off"
    """What the start-up found in checkpoint.dir/compile-cache: off, none, damaged or 'warm (N files)'."""
    compile_key: str = ""
    masters: MasterWeights | None = None
    """fp32 master weights behind bf16 working weights (train.param_dtype=bf16)."""


def build(cfg: Config, rt: Runtime, started_at: float | None = None) -> Run:
    started_at = time.perf_counter() if started_at is None else started_at
    clock = Startup(started_at)
    clock.mark("imports_and_process_group")
    fast = Fast.resolve(cfg, rt)
    say = Progress(rt.is_main)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not cfg.train.deterministic
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not cfg.train.deterministic
    if cfg.optim.lookahead_every and rt.strategy == "fsdp":
        raise ConfigError("optim.lookahead_every (Lookahead) does not work with train.strategy=fsdp; set optim.lookahead_every=0 or use ddp")

    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    with torch.device(rt.device):  # initialised where it trains: seconds less for seednet's 604 M weights on a GPU
        model = models.build(cfg.model.name)
    clock.mark("model")
    ckpt = Checkpointer(cfg, rt.is_main, fast.async_save, say=say.line)
    model_part = ModelPart(model, rt.strategy, cfg.model.name)

    resumed_from, error = None, None
    if rt.is_main:
        try:
            resumed_from = ckpt.claim_and_pick(model)  # the run folder's lock (one writer), then the checkpoint
        except ConfigError as e:
            error = e
    agree(rt, error)
    resumed_from = broadcast(rt, resumed_from)
    clock.mark("checkpoint_pick")

    error, splits = None, None
    try:
        splits = data.load(cfg)
    except ConfigError as e:
        error = e
    agree(rt, error)
    train_split, test_split = splits
    clock.mark("data")
    steps_per_epoch = len(train_split) // cfg.train.batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is larger than the training set ({len(train_split)} images); use a smaller batch")

    augment = Augment(cfg, rt, fast.channels_last, rt.per_rank_batch(cfg.train.batch_size), steps_per_epoch)
    if hasattr(model, "init_from_data"):
        model.init_from_data(augment.normalize(train_split.images[:5000].to(rt.device)).cpu())
    model.to(rt.device)
    state = TrainState()
    saved = None
    if resumed_from is not None:
        saved = ckpt.read(resumed_from)
        ckpt.restore(saved, {"model": model_part}, resumed_from)  # before wrapping
    if fast.channels_last and rt.strategy != "fsdp":
        model.to(memory_format=torch.channels_last)
    clock.mark("weights")  # initialised or restored on the device, in their memory format

    root = Path(cfg.checkpoint.dir)
    cache, cache_key = "off", ""
    if fast.compile and cfg.model.compile_cache:  # before anything compiles
        cache_key = compile_cache.key(cfg, rt, fast)
        cache = broadcast(rt, compile_cache.check(root, cache_key) if rt.is_main else None)  # rank 0 checks; then every rank uses it
        compile_cache.use(root, cache_key)
        clock.mark("compile_cache_load")
    masters = None
    if fast.bf16_weights:  # after the checkpoint's fp32 weights are in, before DDP sees the parameters
        masters = MasterWeights(model, compiled=fast.compile)
        model_part.masters = masters
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
    net = parallel.wrap(model, criterion, cfg, rt, fast.compile, fast.bf16, fast.compile_mode)
    clock.mark("wrap")
    optimizer = build_optimizer(model, cfg, rt.cuda, sharded=rt.strategy == "fsdp", masters=masters)
    clock.mark("optimizer")  # the first optimizer imports torch._dynamo (seconds), which compiling needs anyway
    total = steps_per_epoch * cfg.train.epochs
    total = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
    schedule = build_schedule(optimizer, cfg, total, steps_per_epoch)
    lookahead = Lookahead(model, cfg.optim.lookahead_every) if cfg.optim.lookahead_every else None
    ckpt.register(model=model_part, optimizer=OptimizerPart(model, optimizer, rt.strategy, masters),
                  scheduler=schedule, lookahead=lookahead, train=state)
    if saved is not None:
        ckpt.restore(saved, {k: v for k, v in ckpt.parts.items() if k != "model"}, resumed_from)
        del saved
    test_split = data.Split(test_split.images.to(rt.device), test_split.labels.to(rt.device), test_split.classes) if fast.device_resident else test_split
    return Run(
        cfg=cfg, rt=rt, fast=fast, root=root, state=state, train_split=train_split, test_split=test_split,
        model=model, net=net, optimizer=optimizer, schedule=schedule, lookahead=lookahead,
        loader=make_train_loader(cfg, rt, train_split, fast.device_resident, augment), augment=augment,
        steps_per_epoch=steps_per_epoch, total_steps=total, stop=StopFlag(rt),
        checkpointer=ckpt,
        metrics=RunLog(root, rt, cfg.train.tensorboard, state.step if resumed_from else None), say=say, resumed_from=resumed_from, started_at=started_at,
        compile_cache=cache, compile_key=cache_key, masters=masters, startup=clock,
        watchdog=Watchdog(cfg.dist.hang_timeout_s, root, rt.rank),
    )
