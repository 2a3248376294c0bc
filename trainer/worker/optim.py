"""Optimizer, learning-rate schedule and Lookahead, built from ``cfg.optim``."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import Config


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


def build_optimizer(model: nn.Module, cfg: Config, cuda: bool, sharded: bool = False, masters: MasterWeights | None = None) -> torch.optim.Optimizer:
    o = cfg.optim
    kw = impl_kwargs("foreach" if sharded and o.impl == "auto" else o.impl, cuda)
    groups = param_groups(model, cfg)
    if o.name == "sgd":
        opt = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, **kw)
        if masters:
            masters.attach(opt)
        return opt
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

    @torch.no_grad()
    def from_model(self) -> None:
        """The slow weights start from the model's (restored) weights: a checkpoint without Lookahead."""
        torch._foreach_copy_(self._slow, self._fast)
        for fast, slow in self._counters:
            slow.copy_(fast)


def _sgd_on_masters(masters: list, weights: list, grads: list, buffers: list, lr: torch.Tensor, momentum: float, weight_decay: float,
                    nesterov: bool) -> None:
    """torch.optim.SGD's update (dampening 0) of fp32 master weights from bf16 gradients, then the
    bf16 working copies. Compiled, each tensor's update is one kernel that reads the master, the
    gradient (and the momentum) once and writes the master and its copy: 12 bytes a weight without
    momentum, where casting the gradients to fp32 first and running the fused SGD takes 24."""
    for master, weight, grad, buf in zip(masters, weights, grads, buffers, strict=True):
        d = grad.float()
        if weight_decay:
            d = d.add(master, alpha=weight_decay)
        if momentum:
            buf.mul_(momentum).add_(d)  # a zero buffer on the first step: the same as torch's clone of d
            d = d.add(buf, alpha=momentum) if nesterov else buf
        master.sub_(lr * d)
        weight.copy_(master)


class MasterWeights:
    """bf16 working weights for forward and backward, fp32 master weights for the update
    (train.param_dtype=bf16), and a checkpoint part of its own ("masters": the fp32 weights and
    their momentum). Made before wrapping, so DDP sees the bf16 weights: each weight matrix
    (ndim > 1) becomes bf16 in place and gets an fp32 master. The optimizer holds the working
    weights like any other parameter; a step pre-hook updates their masters from the bf16
    gradients (``_sgd_on_masters``), copies them back and clears those gradients, so the
    optimizer's own step skips them and updates only the rest."""

    def __init__(self, model: nn.Module, compiled: bool):
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.ndim > 1 and p.dtype == torch.float32]
        with torch.no_grad():
            self.masters = {n: p.detach().clone() for n, p in self.named}  # keeps the memory format
            for _, p in self.named:
                p.data = p.data.to(torch.bfloat16)
        self.momentum: dict[str, torch.Tensor] = {}
        """Momentum buffers of the masters (made by attach when their group has momentum)."""
        self._update = torch.compile(_sgd_on_masters, dynamic=False) if compiled else _sgd_on_masters
        self._plan: list[tuple[int, list[str]]] = []
        self._lr: dict[int, torch.Tensor] = {}

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook the master update in front of ``optimizer.step()``; which weights sit in which
        param group is worked out here, once, not every step."""
        name_of = {id(p): n for n, p in self.named}
        self._plan = []  # (group index, names of its weights that have masters)
        for i, group in enumerate(optimizer.param_groups):
            names = [name_of[id(p)] for p in group["params"] if id(p) in name_of]
            if names:
                self._plan.append((i, names))
                if group["momentum"]:  # made here, before any compiled step reads them
                    self.momentum.update({n: torch.zeros_like(self.masters[n]) for n in names})
        self._lr = {i: torch.zeros((), device=self.masters[names[0]].device) for i, names in self._plan}
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.step(opt))

    # -- the checkpoint part --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"weights": dict(self.masters), "momentum": dict(self.momentum)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for n, master in self.masters.items():
            master.copy_(state["weights"][n])
        for n, buf in self.momentum.items():
            if n in state["momentum"]:
                buf.copy_(state["momentum"][n])
            else:  # saved without momentum (optim.momentum was 0)
                buf.zero_()
        self._to_working()

    @torch.no_grad()
    def from_model(self) -> None:
        """Masters from the (restored) working weights, momentum zero: a checkpoint of an fp32 run."""
        for n, p in self.named:
            self.masters[n].copy_(p)
        for buf in self.momentum.values():
            buf.zero_()

    def _to_working(self) -> None:
        for n, p in self.named:
            p.copy_(self.masters[n])

    # -- the update --------------------------------------------------------------------------------
    def _groups(self, optimizer: torch.optim.Optimizer, scratch: bool = False):
        weight = dict(self.named)
        for i, names in self._plan:
            group = optimizer.param_groups[i]  # looked up each time: load_state_dict replaces the group dicts
            masters, weights = [self.masters[n] for n in names], [weight[n] for n in names]
            buffers = [self.momentum[n] for n in names] if group["momentum"] else [None] * len(names)
            if scratch:  # copies of the same shapes, layouts and types: what the compiled update is traced on
                masters, buffers = ([None if t is None else t.clone() for t in ts] for ts in (masters, buffers))
                # Parameters, as the real weights are: traced on plain tensors, the first real step
                # failed the guard and compiled again, after the first-step clock and the cache's seal
                weights = [nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad) for w in weights]
                grads = [torch.zeros_like(w) for w in weights]
            else:
                grads = [w.grad for w in weights]
            yield masters, weights, grads, buffers, self._lr[i], group

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        for masters, weights, grads, buffers, lr, group in self._groups(optimizer):
            if any(g is None for g in grads):
                raise RuntimeError("a bf16 weight got no gradient this step; train.param_dtype=bf16 needs every weight used")
            lr.fill_(group["lr"])  # a device scalar: the schedule changes it without recompiling
            self._update(masters, weights, grads, buffers, lr, group["momentum"], group["weight_decay"], group["nesterov"])
            for w in weights:
                w.grad = None  # the optimizer's own step skips them

    @torch.no_grad()
    def warm_up(self, optimizer: torch.optim.Optimizer) -> None:
        """Compile the update before the clock starts, on scratch copies (the real state stays)."""
        for masters, weights, grads, buffers, lr, group in self._groups(optimizer, scratch=True):
            self._update(masters, weights, grads, buffers, lr, group["momentum"], group["weight_decay"], group["nesterov"])
