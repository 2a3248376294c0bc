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

from trainer import checkpoint, data, models, parallel
from trainer.config import Config, ConfigError
from trainer.dist import Runtime, agree, broadcast
from trainer.faults import StopFlag
from trainer.loader import Augment, make_train_loader
from trainer.metrics import Progress, RunLog
from trainer.optim import Lookahead, build_optimizer, build_schedule


@dataclass
class TrainState:
    epoch: int = 0
    """Epoch in progress (epochs finished so far)."""
    epoch_step: int = 0
    """Steps finished inside that epoch: a resumed run skips these global batches."""
    step: int = 0
    """Optimizer steps finished in all."""


@dataclass(frozen=True)
class Fast:
    """The fast path's switches as resolved for this process (auto = on for CUDA)."""

    bf16: bool
    channels_last: bool
    compile: bool
    device_resident: bool
    async_save: bool

    @classmethod
    def resolve(cls, cfg: Config, rt: Runtime) -> Fast:
        def auto(value: bool | None) -> bool:
            return rt.cuda if value is None else value

        compile_model = auto(cfg.model.compile) and rt.strategy != "dp"
        if cfg.model.compile and rt.strategy == "dp":
            raise ConfigError("model.compile=true does not work with train.strategy=dp; use model.compile=false (or auto) or train.strategy=ddp")
        return cls(
            bf16=cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and rt.cuda),
            channels_last=auto(cfg.model.channels_last),
            compile=compile_model,
            device_resident=cfg.data.device_resident,
            async_save=auto(cfg.checkpoint.async_save),
        )

    def __str__(self) -> str:
        on = [f.name for f in fields(self) if getattr(self, f.name)]
        return "fast path: " + (", ".join(on) if on else "off")


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
    eval_model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Any
    lookahead: Lookahead | None
    loader: Any
    augment: Augment
    steps_per_epoch: int
    total_steps: int
    stop: StopFlag
    writer: checkpoint.AsyncWriter | None
    log: RunLog
    say: Progress
    resumed_from: Path | None
    started_at: float


def _state_bytes(model: nn.Module, cfg: Config) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    copies = 1 + (2 if cfg.optim.name == "adamw" else int(cfg.optim.momentum > 0)) + int(cfg.optim.ema_every > 0)
    return n * copies


def _prechecks(cfg: Config, rt: Runtime, model: nn.Module, say: Progress) -> Path | None:
    """Rank 0: write probe, leftover temporaries, and which checkpoint to resume from."""
    root = Path(cfg.checkpoint.dir)
    checkpoint.probe(root, _state_bytes(model, cfg))
    path = checkpoint.explicit_resume(root, cfg.checkpoint.resume)
    checkpoint.clean_temporaries(root)
    if cfg.checkpoint.resume == "auto":
        return checkpoint.newest_good(root, log=say.line)
    return path


def _load_weights(model: nn.Module, state: dict, cfg: Config, path: Path) -> None:
    checkpoint.check_model(state.get("model_name"), cfg.model.name, path)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        detail = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
        raise checkpoint.CheckpointError(f"checkpoint {path} does not fit model {cfg.model.name} ({detail}); use a checkpoint of this model") from None


def build(cfg: Config, rt: Runtime, started_at: float | None = None) -> Run:
    started_at = time.perf_counter() if started_at is None else started_at
    fast = Fast.resolve(cfg, rt)
    say = Progress(rt.is_main)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not cfg.train.deterministic
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not cfg.train.deterministic
    if cfg.optim.ema_every and rt.strategy == "fsdp":
        raise ConfigError("optim.ema_every (Lookahead) does not work with train.strategy=fsdp; set optim.ema_every=0 or use ddp")

    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    model = models.build(cfg.model.name)

    resumed_from, error = None, None
    if rt.is_main:
        try:
            resumed_from = _prechecks(cfg, rt, model, say)
        except ConfigError as e:
            error = e
    agree(rt, error)
    resumed_from = broadcast(rt, resumed_from)

    error, splits = None, None
    try:
        splits = data.load(cfg)
    except ConfigError as e:
        error = e
    agree(rt, error)
    train_split, test_split = splits
    steps_per_epoch = len(train_split) // cfg.train.batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is larger than the training set ({len(train_split)} images); use a smaller batch")

    augment = Augment(cfg, rt, fast.channels_last, rt.per_rank_batch(cfg.train.batch_size), steps_per_epoch)
    if hasattr(model, "init_from_data"):
        model.init_from_data(augment.normalize(train_split.images[:5000].to(rt.device)).cpu())
    model.to(rt.device)
    state = TrainState()
    ckpt = None
    if resumed_from is not None:
        # rank 0 checked size and checksum when it chose this checkpoint (auto) or checks them now
        ckpt = checkpoint.load(resumed_from, verify_checksum=rt.is_main and cfg.checkpoint.resume != "auto")
        _load_weights(model, ckpt, cfg, resumed_from)
        state = TrainState(ckpt["epoch"], ckpt["epoch_step"], ckpt["step"])
    if fast.channels_last and rt.strategy != "fsdp":
        model.to(memory_format=torch.channels_last)

    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
    net = parallel.wrap(model, criterion, cfg, rt, fast.compile, fast.bf16)
    optimizer = build_optimizer(model, cfg, rt.cuda, sharded=rt.strategy == "fsdp")
    total = steps_per_epoch * cfg.train.epochs
    total = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
    schedule = build_schedule(optimizer, cfg, total, steps_per_epoch)
    lookahead = Lookahead(model, cfg.optim.ema_every) if cfg.optim.ema_every else None
    if ckpt is not None:
        parallel.load_optimizer_state(model, optimizer, ckpt["optimizer"], rt)
        schedule.load_state_dict(ckpt["scheduler"])
        if lookahead is not None and ckpt.get("lookahead"):
            lookahead.load_state_dict(ckpt["lookahead"])
        del ckpt
    test_split = data.Split(test_split.images.to(rt.device), test_split.labels.to(rt.device), test_split.classes) if fast.device_resident else test_split
    root = Path(cfg.checkpoint.dir)
    return Run(
        cfg=cfg, rt=rt, fast=fast, root=root, state=state, train_split=train_split, test_split=test_split,
        model=model, eval_model=model, net=net, optimizer=optimizer, schedule=schedule, lookahead=lookahead,
        loader=make_train_loader(cfg, rt, train_split, fast.device_resident, augment), augment=augment,
        steps_per_epoch=steps_per_epoch, total_steps=total, stop=StopFlag(rt),
        writer=checkpoint.AsyncWriter() if fast.async_save and rt.is_main else None,
        log=RunLog(root, rt), say=say, resumed_from=resumed_from, started_at=started_at,
    )
