"""Wrapping the model for its strategy, and moving state in and out of the wrapped model.

Order matters and is the same for every strategy: build the model, load the checkpoint's weights
into the plain module, *then* wrap it (DataParallel, DistributedDataParallel or fully_shard) and
compile, then build the optimizer and load its state (trainer/worker/checkpoint/ owns what is saved and
how it comes back).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from trainer.config import Config
from trainer.worker.models import unwrap
from trainer.worker.runtime import Runtime
from trainer.worker.speed import Extras


class WithLoss(nn.Module):
    """The model and its loss as one module, called as ``net(images, labels) -> mean loss``.
    Compiled together, the loss (log-softmax, label smoothing, mean) and its backward join the
    model's graphs instead of running as a dozen eager kernels, each launched from Python: host
    time that a launch-bound step pays in full (BENCHMARKS.md, the speed recipe's profile)."""

    def __init__(self, model: nn.Module, criterion: nn.Module):
        super().__init__()
        self.model, self.criterion = model, criterion

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.model(x), y)


def wrap(
    model: nn.Module,
    criterion: nn.Module,
    cfg: Config,
    rt: Runtime,
    compile_model: bool,
    bf16: bool,
    extras: Extras,
    mode: str = "default",
) -> nn.Module:
    """The module that training calls, ``net(images, labels) -> loss``; ``model`` itself stays
    usable for evaluation. The extras' part before the wrap comes first (bf16 weights' masters)."""
    extras.before_wrap(model)
    if rt.strategy == "dp":
        # DataParallel copies the module to every GPU on every forward, from one process: the GIL
        # and the copies are why the article found it slow. Kept for comparison; never compiled.
        # The loss is taken on the gathered outputs, as the article did.
        return WithLoss(nn.DataParallel(model), criterion)
    net = WithLoss(model, criterion)
    if rt.strategy == "fsdp":
        _shard(model, cfg, bf16)
        return torch.compile(net, mode=mode) if compile_model else net
    if rt.strategy == "ddp":
        return _ddp(net, model, cfg, rt, extras, compile_model, mode)
    return torch.compile(net, mode=mode) if compile_model else net


def _ddp(
    net: nn.Module, model: nn.Module, cfg: Config, rt: Runtime, extras: Extras, compile_model: bool, mode: str
) -> nn.Module:
    """DDP around the model with its loss, compiled around it (see below), with the comm hook and the speed
    recipes' split asked for."""
    d = cfg.dist
    ddp = nn.parallel.DistributedDataParallel
    split = extras.ddp(net, model, rt.world_size if rt.collectives else 1)  # gathered factors; split at buckets?
    # torch 2.14 (pinned) renamed the per-forward buffer broadcast (the old name warns);
    # torch 2.11 has only the old one
    sync = (
        "forward_sync_buffers"
        if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
        else "broadcast_buffers"
    )
    net = ddp(
        net,
        device_ids=[rt.device.index] if rt.cuda else None,
        bucket_cap_mb=d.bucket_mb,
        gradient_as_bucket_view=d.gradient_as_bucket_view,
        static_graph=d.static_graph,
        **{sync: d.broadcast_buffers},
    )
    if d.comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if d.comm_hook == "bf16" else default_hooks.fp16_compress_hook
        net.register_comm_hook(None, hook)
    # Compile *around* DDP: dynamo then splits the graph at bucket boundaries so gradients are
    # all-reduced while backward still runs (dist.split_graph_at_buckets). One graph instead
    # means every gradient arrives (and is sent) only at the end of backward, but half the
    # graph launches: the better trade for a small model whose step is launch-bound.
    torch._dynamo.config.optimize_ddp = split
    return torch.compile(net, mode=mode) if compile_model else net


def _shard(model: nn.Module, cfg: Config, bf16: bool) -> None:
    """fully_shard every large layer, then the root: each rank keeps 1/W of the weights, gradients
    and optimizer state; weights are gathered (in bf16 when autocast is on) just before use."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        # fp32 reduction of bf16 gradients; without autocast None keeps the parameters' own dtype
        reduce_dtype=torch.bfloat16 if cfg.dist.reduce_dtype == "bf16" else (torch.float32 if bf16 else None),
    )
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)) and m.weight.numel() >= 1_000_000:
            # Keep gathered weights through backward: no second all-gather (costs 1/W of the layer).
            fully_shard(m, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)


def sync_buffers(model: nn.Module, rt: Runtime) -> None:
    """DDP copies rank 0's buffers to the others *before* each forward (unless
    dist.broadcast_buffers=false, and then they drift apart all along), so after the last step each
    rank holds batch-norm statistics of its own last batch. Evaluate (and save) rank 0's."""
    if rt.strategy == "ddp" and rt.collectives:
        import torch.distributed as dist

        for b in unwrap(model).buffers():
            dist.broadcast(b, src=0)
