"""Optimizer and learning-rate schedule, built from ``cfg.optim`` (Lookahead and fp32 masters:
trainer/worker/speed.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import Config


def param_groups(model: nn.Module, cfg: Config, head: frozenset[str] | None = None) -> list[dict]:
    """Weights get lr and weight decay; biases and norm parameters (1-D) get lr x bias_lr_scale and
    weight decay / bias_lr_scale, so their decay per step (lr x wd) is the same. With a pretrained
    start (``head``: the new head's parameter names) the other, pretrained, parameters get their own
    groups at lr x backbone_lr_scale, marked ``pretrained`` for the freeze (build_schedule)."""
    o = cfg.optim
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    kinds = [(False, 1.0)] if head is None else [(False, 1.0), (True, o.backbone_lr_scale)]
    groups = []
    for pretrained, scale in kinds:
        mine = [(n, p) for n, p in named if head is None or (n not in head) == pretrained]
        weights = [p for _, p in mine if p.ndim > 1]
        others = [p for _, p in mine if p.ndim <= 1]
        tag = {"pretrained": True} if pretrained else {}
        if weights:
            groups.append({"params": weights, "lr": o.lr * scale, "weight_decay": o.weight_decay, **tag})
        if others:
            groups.append(
                {
                    "params": others,
                    "lr": o.lr * o.bias_lr_scale * scale,
                    "weight_decay": o.weight_decay / o.bias_lr_scale,
                    **tag,
                }
            )
    return groups


def impl_kwargs(impl: str, cuda: bool) -> dict:
    if impl == "auto":
        impl = "fused" if cuda else "foreach"
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


def build_optimizer(model: nn.Module, cfg: Config, cuda: bool, sharded: bool = False) -> torch.optim.Optimizer:
    """The optimizer over param_groups; with a pretrained start the new head's parameters apart."""
    from trainer.worker.pretrained import head_keys

    o = cfg.optim
    kw = impl_kwargs("foreach" if sharded and o.impl == "auto" else o.impl, cuda)
    groups = param_groups(model, cfg, head_keys(cfg.model.name, cfg.data.image_size) if cfg.model.weights else None)
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
    t = min(1.0, (step - warm) / max(1, total - warm))  # never past the end: a negative rate would climb the loss
    if o.schedule == "cosine":
        return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * t))
    return 1 - (1 - end) * t  # triangle: linear up, linear down


def build_schedule(optimizer: torch.optim.Optimizer, cfg: Config, total: int, steps_per_epoch: int):
    """One schedule for every group; the pretrained groups' rate is 0 for the first
    model.freeze_epochs epochs (a function of the step alone, so a resume lands on the same rate)."""
    frozen = cfg.model.freeze_epochs * steps_per_epoch

    def factor(pretrained: bool):
        return lambda s: 0.0 if pretrained and s < frozen else lr_factor(cfg, s, total, steps_per_epoch)

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, [factor(bool(g.get("pretrained"))) for g in optimizer.param_groups]
    )
