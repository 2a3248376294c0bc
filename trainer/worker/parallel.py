"""Wrapping the model for its strategy, and moving state in and out of the wrapped model.

Order matters and is the same for every strategy: build the model, load the checkpoint's weights
into the plain module, *then* wrap it (DataParallel, DistributedDataParallel or fully_shard) and
compile, then build the optimizer and load its state (trainer/worker/checkpoint.py owns what is saved and
how it comes back).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from trainer.config import Config
from trainer.worker.models import unwrap
from trainer.worker.runtime import Runtime


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


def wrap(model: nn.Module, criterion: nn.Module, cfg: Config, rt: Runtime, compile_model: bool, bf16: bool, mode: str = "default") -> nn.Module:
    """The module that training calls, ``net(images, labels) -> loss``; ``model`` itself stays
    usable for evaluation."""
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
        d = cfg.dist
        ddp = nn.parallel.DistributedDataParallel
        if d.gather_linear_factors is not False and rt.collectives:
            gathered = gather_linear_factors(model, cfg.train.batch_size, rt.world_size, force=bool(d.gather_linear_factors))
            # DDP leaves these weights alone: their gradients arrive already summed over the ranks
            ddp._set_params_and_buffers_to_ignore_for_model(net, [f"model.{n}.{k}" for n in gathered for k in ("weight", "bias")])
        # torch 2.14 (pinned) renamed the per-forward buffer broadcast (the old name warns); torch 2.11 has only the old one
        sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters else "broadcast_buffers"
        net = ddp(
            net, device_ids=[rt.device.index] if rt.cuda else None, bucket_cap_mb=d.bucket_mb,
            gradient_as_bucket_view=d.gradient_as_bucket_view, static_graph=d.static_graph, **{sync: d.broadcast_buffers},
        )
        if d.comm_hook != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.bf16_compress_hook if d.comm_hook == "bf16" else default_hooks.fp16_compress_hook
            net.register_comm_hook(None, hook)
        # Compile *around* DDP: dynamo then splits the graph at bucket boundaries so gradients are
        # all-reduced while backward still runs (dist.split_graph_at_buckets). One graph instead
        # means every gradient arrives (and is sent) only at the end of backward, but half the
        # graph launches: the better trade for a small model whose step is launch-bound.
        torch._dynamo.config.optimize_ddp = split_at_buckets(model, d.split_graph_at_buckets, d.bucket_mb, rt.world_size)
        return torch.compile(net, mode=mode) if compile_model else net
    return torch.compile(net, mode=mode) if compile_model else net


class _LinearWithGatheredFactors(torch.autograd.Function):
    """y = x W^T + b, whose weight gradient over the whole job, sum over ranks r of dy_r^T x_r,
    each rank forms from every rank's x (all-gathered during forward, while the rest of the
    forward runs) and dy (all-gathered in backward): (in + out) x batch values on the wire."""

    @staticmethod
    def forward(ctx, x, weight, bias, world):
        y = torch.nn.functional.linear(x, weight, bias)  # under autocast: bf16 x, W and y
        flat = x.to(y.dtype).reshape(-1, x.shape[-1]).contiguous()
        xs = flat.new_empty((world * flat.shape[0], flat.shape[1]))
        ctx.work = torch.distributed.all_gather_into_tensor(xs, flat, async_op=True)
        ctx.xs = xs  # not save_for_backward: the gather writes it after this returns
        ctx.save_for_backward(weight)
        ctx.world, ctx.x_shape, ctx.x_dtype, ctx.has_bias = world, x.shape, x.dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        (weight,), xs = ctx.saved_tensors, ctx.xs
        d = dy.to(xs.dtype).reshape(-1, dy.shape[-1]).contiguous()
        dx = (d @ weight.to(d.dtype)).reshape(ctx.x_shape).to(ctx.x_dtype)
        dys = d.new_empty((ctx.world * d.shape[0], d.shape[1]))
        torch.distributed.all_gather_into_tensor(dys, d)  # the compute stream waits for it; the host does not
        ctx.work.wait()
        dw = (dys.t() @ xs).div_(ctx.world).to(weight.dtype)  # the mean over the ranks, as DDP's
        db = dys.sum(0).div_(ctx.world) if ctx.has_bias else None
        return dx, dw, db, None


class GatheredFactorsLinear(nn.Linear):
    """nn.Linear whose training steps use _LinearWithGatheredFactors (dist.gather_linear_factors);
    same parameters and state dict. Eager, outside the compiled graphs: two small collectives
    (gather_linear_factors wraps forward in torch.compiler.disable at first use, not at import:
    importing torch._dynamo creates the default inductor cache folder on the node, before
    compile_cache has pointed it at the volume)."""

    world = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):  # evaluation: no collectives (rank 0 may evaluate alone)
            return super().forward(x)
        return _LinearWithGatheredFactors.apply(x, self.weight, self.bias, self.world)


FACTOR_RATIO = 16


def gather_linear_factors(model: nn.Module, global_batch: int, world: int, force: bool = False) -> list[str]:
    """Turn the Linear layers whose factors are FACTOR_RATIO times fewer values than their
    gradient (all of them when ``force``) into GatheredFactorsLinear; returns their names."""
    global _outside_graphs
    names = []
    for name, m in model.named_modules():
        if type(m) is nn.Linear and (force or m.in_features * m.out_features >= FACTOR_RATIO * (m.in_features + m.out_features) * global_batch):
            m.__class__, m.world = GatheredFactorsLinear, world
            names.append(name)
    if names and not _outside_graphs:
        GatheredFactorsLinear.forward = torch.compiler.disable(GatheredFactorsLinear.forward)
        _outside_graphs = True
    return names


_outside_graphs = False  # GatheredFactorsLinear.forward is wrapped in torch.compiler.disable


SPLIT_BUCKETS = 4


def split_at_buckets(model: nn.Module, setting: bool | None, bucket_mb: int, world_size: int) -> bool:
    """dist.split_graph_at_buckets resolved: auto splits when the gradients fill more than
    SPLIT_BUCKETS buckets, where hiding their all-reduce behind backward is worth the extra graphs,
    and never for one process: it has nothing to hide, and torch caches no AOTAutograd result for
    split subgraphs, so every restart traced them again (1.2 s of seed.yaml's on one GPU)."""
    if setting is not None:
        return setting
    if world_size == 1:
        return False
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return grad_bytes > SPLIT_BUCKETS * bucket_mb * 2**20


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
