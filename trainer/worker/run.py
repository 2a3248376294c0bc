"""Everything a run needs before its first step, in one straight line (``build``): the checkpoint
to resume from (rank 0 claims the folder), data, model, wrapping, optimizer and schedule, then one
restore of every part the checkpoint holds."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.config import Config, ConfigError
from trainer.worker import compile_cache, data, models, parallel, pretrained
from trainer.worker.checkpoint.checkpointer import Checkpointer, CheckpointLost
from trainer.worker.checkpoint.parts import ModelPart, OptimizerPart, TrainState
from trainer.worker.data.loader import Augment, make_train_loader
from trainer.worker.metrics import Progress, RunLog, Startup
from trainer.worker.optim import build_optimizer, build_schedule
from trainer.worker.runtime import Runtime, agree, broadcast
from trainer.worker.speed import Extras
from trainer.worker.stop import StopFlag
from trainer.worker.watchdog import Watchdog


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

        if problem := cfg.combination_problem(rt.strategy, rt.cuda):  # the config's rules with what auto became here
            raise ConfigError(problem)
        compile_model = auto(cfg.model.compile) and rt.strategy != "dp"
        bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and rt.cuda)
        bf16_weights = cfg.train.param_dtype == "bf16" or (
            cfg.train.param_dtype == "auto" and bf16 and cfg.bf16_weights_problem(rt.strategy) is None
        )
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
    train_split: Any
    """data.Split in memory, or stream.Streamed (the shards stay where they are)."""
    test_split: Any
    data_plan: data.Plan
    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Any
    extras: Extras
    """The speed recipes' pieces (bf16 weights' fp32 masters, Lookahead, ...): trainer/worker/speed.py."""
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
    weights: str = ""
    """What the start line says of a pretrained start ("" for none, or a resumed run)."""
    hosts: list = field(default_factory=list)
    """Each rank's host name and addresses (dist.gather_hosts): a lost peer or a straggler is named by its host."""


def build(cfg: Config, rt: Runtime, started_at: float | None = None) -> Run:
    clock = Startup(time.perf_counter() if started_at is None else started_at)
    clock.mark("imports_and_process_group")
    fast, say = Fast.resolve(cfg, rt), Progress(rt.is_main)
    set_numerics(cfg)
    sharded = rt.strategy == "fsdp" and rt.collectives
    ckpt = Checkpointer(cfg, rt.is_main, fast.async_save, sharded=sharded, say=say.line)
    resumed_from = pick_checkpoint(ckpt, rt)
    clock.mark("checkpoint_pick")
    train_split, test_split, steps_per_epoch, plan = load_data(cfg, rt, fast)
    # streamed: nothing resident (the start line says so)
    fast = replace(fast, device_resident=fast.device_resident and not plan.stream)
    ckpt.classes = train_split.classes
    clock.mark("data")
    weights, augment = start_from(cfg, rt, fast, steps_per_epoch, resumed_from, ckpt)
    model = build_model(cfg, rt, fast, augment, train_split, fresh=resumed_from is None, weights=weights)
    clock.mark("model")
    cache, cache_key = use_compile_cache(cfg, rt, fast, clock)  # before anything compiles
    extras = Extras(cfg, fast.compile, fast.bf16_weights)  # the speed recipes' pieces: none unless asked for
    net = wrap(model, cfg, rt, fast, extras)
    clock.mark("wrap")
    optimizer, schedule, total = optimize(model, cfg, rt, extras, steps_per_epoch)
    clock.mark("optimizer")  # the first optimizer imports torch._dynamo (seconds), which compiling needs anyway
    state = TrainState()
    parts = {"model": ModelPart(model, cfg.model.name), "optimizer": OptimizerPart(model, optimizer)}
    ckpt.register(**parts, scheduler=schedule, **extras.parts(), train=state)
    if resumed_from is not None:
        resumed_from = confirm_checkpoint(ckpt, rt, resumed_from)
        ckpt.restore(resumed_from)
        clock.mark("restore")
    # one line per concern: the run, its data, its model and optimizer, its checkpoints and records
    # fmt: off
    return Run(
        cfg=cfg, rt=rt, fast=fast, root=ckpt.root, state=state, stop=StopFlag(rt), say=say, startup=clock,
        train_split=train_split, test_split=test_split, data_plan=plan, steps_per_epoch=steps_per_epoch,
        total_steps=total, loader=make_loader(cfg, rt, train_split, fast, augment), augment=augment,
        model=model, net=net, optimizer=optimizer, schedule=schedule, extras=extras,
        weights=weights.describe() if weights else "", checkpointer=ckpt, resumed_from=resumed_from,
        compile_cache=cache, compile_key=cache_key, started_at=clock.started_at,
        metrics=RunLog(ckpt.root, rt, cfg.train.tensorboard, state.step if resumed_from else None),
        watchdog=Watchdog.of(cfg, rt, ckpt.root),
    )
    # fmt: on


def wrap(model: nn.Module, cfg: Config, rt: Runtime, fast: Fast, extras: Extras) -> nn.Module:
    """The model with its loss, wrapped for the strategy (DP, DDP, FSDP) and compiled as the fast path says."""
    loss = nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
    return parallel.wrap(model, loss, cfg, rt, fast.compile, fast.bf16, extras, fast.compile_mode)


def optimize(model: nn.Module, cfg: Config, rt: Runtime, extras: Extras, steps_per_epoch: int) -> tuple[Any, Any, int]:
    """The optimizer, its learning-rate schedule over the run's steps, and that step count."""
    optimizer = build_optimizer(model, cfg, rt.cuda, sharded=rt.strategy == "fsdp")
    total = step_count(cfg, steps_per_epoch)
    schedule = build_schedule(optimizer, cfg, total, steps_per_epoch)
    extras.after_optimizer(model, optimizer)
    return optimizer, schedule, total


def step_count(cfg: Config, steps_per_epoch: int) -> int:
    """The run's steps: every epoch's, or train.max_steps where that is fewer."""
    total = steps_per_epoch * cfg.train.epochs
    return min(total, cfg.train.max_steps) if cfg.train.max_steps else total


def set_numerics(cfg: Config) -> None:
    """Deterministic kernels, or the fast ones (cuDNN autotuning, TF32 matmuls)."""
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not cfg.train.deterministic
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not cfg.train.deterministic


def pick_checkpoint(ckpt: Checkpointer, rt: Runtime) -> Path | None:
    """Rank 0 claims the checkpoint folder and picks the checkpoint; every rank learns which
    (or every rank raises rank 0's error)."""
    resumed_from, error = None, None
    if rt.is_main:
        try:
            resumed_from = ckpt.claim_and_pick()
        except ConfigError as e:
            error = e
    agree(rt, error)
    return broadcast(rt, resumed_from)


def confirm_checkpoint(ckpt: Checkpointer, rt: Runtime, picked: Path) -> Path:
    """Rank 0 waits for the picked checkpoint's checksums (or falls back to an older one); every
    rank learns which it restores."""
    confirmed: Path | str = picked
    if rt.is_main:
        try:
            confirmed = ckpt.confirm(picked)
        except CheckpointLost as e:
            confirmed = str(e)
    confirmed = broadcast(rt, confirmed)
    if isinstance(confirmed, str):  # every rank stops alike: a crash, and the next attempt starts from scratch
        raise CheckpointLost(confirmed)
    return confirmed


def make_loader(cfg: Config, rt: Runtime, split: Any, fast: Fast, augment: Augment):
    """The streamed loader for a set left in its shards, else an in-memory one."""
    from trainer.worker.data.stream import Streamed, StreamLoader, gpu_decode

    if isinstance(split, Streamed):
        return StreamLoader(split, cfg, rt, rt.per_rank_batch(cfg.train.batch_size), augment, gpu_decode(cfg, rt))
    return make_train_loader(cfg, rt, split, fast.device_resident, augment)


def load_data(cfg: Config, rt: Runtime, fast: Fast) -> tuple[Any, Any, int, data.Plan]:
    """The training and test splits (in memory: the test split on the device when
    data.device_resident; streamed: left in the shards), the steps of one epoch and the plan the
    start line prints. data.image_size is resolved here (set in the run's ``cfg``) and checked
    against the model."""
    from trainer.worker.data.stream import Streamed

    error, splits, plan = None, None, None
    try:
        gpu = torch.cuda.get_device_properties(rt.device).total_memory if rt.cuda and fast.device_resident else None
        plan = data.plan(cfg, gpu, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        # the run's config: the size the model, the data and the checkpoint's record take
        cfg.data.image_size = plan.image_size
        if problem := models.input_problem(cfg.model.name, cfg.data.image_size):
            raise ConfigError(problem)
        root = Path(cfg.data.dir)
        splits = (Streamed(root, "train"), Streamed(root, "test")) if plan.stream else data.load(cfg)
    except ConfigError as e:
        error = e
    agree(rt, error)
    train_split, test_split = splits
    steps_per_epoch = len(train_split) // cfg.train.batch_size
    if steps_per_epoch == 0:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is larger than the training set ({len(train_split)} images); "
            f"use a smaller batch"
        )
    if fast.device_resident and not plan.stream:
        test_split = data.Split(
            test_split.images.to(rt.device), test_split.labels.to(rt.device), test_split.classes, test_split.paths
        )
    return train_split, test_split, steps_per_epoch, plan


def start_from(
    cfg: Config, rt: Runtime, fast: Fast, steps_per_epoch: int, resumed_from: Path | None, ckpt: Checkpointer
) -> tuple[pretrained.Weights | None, Augment]:
    """The pretrained weights of a fresh run (if any) and the augmentation, which normalises the
    images by a resumed run's own mean and std (its checkpoint says), else the weights', else the
    image size's; the checkpointer saves them with every checkpoint."""
    weights, norm = None, data.norm_stats(cfg.data.image_size)
    if resumed_from is None:
        weights = pretrained.resolve(cfg.model.name, cfg.model.weights)
        norm = (weights.mean, weights.std) if weights else norm
    else:
        from trainer.worker.checkpoint import folder as files

        folder = resumed_from if resumed_from.is_dir() else resumed_from.parent
        if (folder / files.META).is_file():  # else the restore says what the path is not
            norm = pretrained.normalization_of(files.read_meta(folder))
    ckpt.normalize = {"mean": list(norm[0]), "std": list(norm[1])}
    return weights, Augment(cfg, rt, fast.channels_last, rt.per_rank_batch(cfg.train.batch_size), steps_per_epoch, norm)


def build_model(
    cfg: Config,
    rt: Runtime,
    fast: Fast,
    augment: Augment,
    train_split: data.Split,
    fresh: bool = True,
    weights: pretrained.Weights | None = None,
) -> nn.Module:
    """The model, initialised on its device (seconds less for seednet's 604 M weights on a GPU) and
    in its memory format; the same initial weights on every rank (a pretrained start's, every tensor
    but the new head's). A checkpoint's weights replace them later, in place."""
    torch.manual_seed(cfg.train.seed)
    with torch.device(rt.device):
        model = models.build(cfg.model.name, len(train_split.classes), cfg.data.image_size)
    if weights is not None and fresh:
        pretrained.load_into(model, weights, cfg.model.name, cfg.data.image_size)
        fresh = False  # airnet's whitening came with the weights
    # Weights computed from data (airnet's whitening: 1.4 s of a start on an H200 node, seconds on a
    # laptop's CPU) only for a fresh run: a resumed one's checkpoint overwrites them. It draws no
    # random numbers, so skipping it moves nothing else.
    if hasattr(model, "init_from_data") and fresh:
        images = (
            train_split.images[:5000]
            if train_split.images is not None
            else train_split.sample(1024, cfg.data.image_size)
        )
        model.init_from_data(augment.eval(images.to(rt.device)).cpu())
    model.to(rt.device)
    if fast.channels_last and rt.strategy != "fsdp":
        model.to(memory_format=torch.channels_last)
    return model


def use_compile_cache(cfg: Config, rt: Runtime, fast: Fast, clock: Startup) -> tuple[str, str]:
    """Point the compilers' caches at checkpoint.dir/compile-cache/KEY; (what rank 0 found there, KEY)."""
    if not (fast.compile and cfg.model.compile_cache):
        return "off", ""
    key = compile_cache.key(cfg, rt, fast)
    root = cfg.checkpoint.root
    # rank 0 checks; then every rank uses it
    found = broadcast(rt, compile_cache.check(root, key) if rt.is_main else None)
    compile_cache.use(root, key)
    clock.mark("compile_cache_load")
    return found, key
