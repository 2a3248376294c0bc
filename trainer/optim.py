"""Optimizer, learning-rate schedule and Lookahead, built from ``cfg.optim``."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import Config, ConfigError


def param_groups(model: nn.Module, cfg: Config) -> list[dict]:
    """Weights get lr and weight decay; biases and norm parameters (1-D) get lr x bias_lr_scale and
    weight decay / bias_lr_scale, so their decay per step (lr x wd) is the same."""
    o = cfg.optim
    weights = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    others = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": weights, "lr": o.lr, "weight_decay": o.weight_decay}]
    if others:
        groups.append({"params": others, "lr": o.lr * o.bias_lr_scale, "weight_decay": o.weight_decay / o.bias_lr_scale})
    return groups


def impl_kwargs(impl: str, cuda: bool) -> dict:
    if impl == "auto":
        impl = "fused" if cuda else "foreach"
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


def build_optimizer(model: nn.Module, cfg: Config, cuda: bool, sharded: bool = False) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.impl == "fused" and not cuda:
        raise ConfigError("optim.impl=fused needs CUDA; use optim.impl=foreach (or auto) on the CPU")
    if o.impl == "fused" and sharded:
        raise ConfigError("optim.impl=fused does not run on fsdp's sharded parameters; use optim.impl=foreach (or auto)")
    kw = impl_kwargs("foreach" if sharded and o.impl == "auto" else o.impl, cuda)
    groups = param_groups(model, cfg)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, **kw)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.momentum, 0.999), **kw)


def lr_factor(cfg: Config, step: int, total: int, steps_per_epoch: int) -> float:
    """Multiplier of the peak learning rate at ``step`` of ``total``."""
    o = cfg.optim
    if o.schedule == "constant":
        return 1.0
    warm = min(int(o.warmup_epochs * steps_per_epoch), total - 1)
    end = o.final_lr_fraction
    if step < warm:
        start = o.warmup_start
        return start + (1 - start) * step / warm
    t = (step - warm) / max(1, total - warm)
    if o.schedule == "cosine":
        return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * t))
    return 1 - (1 - end) * t  # triangle: linear up, linear down


def build_schedule(optimizer: torch.optim.Optimizer, cfg: Config, total: int, steps_per_epoch: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s, total, steps_per_epoch))


class Lookahead:
    """Every k steps: slow <- slow + a (fast - slow); fast <- slow, with a = 1 - 0.95^k x progress^3
    held back early in training (the fast weights explore, the slow ones average)."""

    def __init__(self, model: nn.Module, every: int):
        self.every = every
        named = [*model.named_parameters(), *model.named_buffers()]
        self.names = [n for n, _ in named]
        tensors = [t for _, t in named]
        self.slow = [t.detach().clone() for t in tensors]
        pairs = list(zip(tensors, self.slow, strict=True))
        self._fast = [f for f, _ in pairs if f.dtype.is_floating_point]
        self._slow = [s for f, s in pairs if f.dtype.is_floating_point]
        self._counters = [(f, s) for f, s in pairs if not f.dtype.is_floating_point]  # e.g. num_batches_tracked

    @torch.no_grad()
    def step(self, step: int, total: int) -> None:
        if step % self.every:
            return
        decay = 0.95**self.every * (step / total) ** 3
        # Two foreach launches over every float tensor instead of two small kernels per tensor: on
        # the speed recipe a step is a few milliseconds, and Python launch time is part of it.
        if self._fast:
            torch._foreach_lerp_(self._slow, self._fast, 1 - decay)
            torch._foreach_copy_(self._fast, self._slow)
        for fast, slow in self._counters:
            slow.copy_(fast)

    def state_dict(self) -> dict:
        return {n: s for n, s in zip(self.names, self.slow, strict=True)}

    def load_state_dict(self, state: dict) -> None:
        for n, s in zip(self.names, self.slow, strict=True):
            s.copy_(state[n])
