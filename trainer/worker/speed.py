"""The speed recipes' extras (configs/seed.yaml, configs/fast.yaml), apart from the standard path:
bf16 working weights with fp32 masters, Lookahead, a Linear's weight gradient from gathered
factors, and splitting compiled DDP graphs at buckets.

A run reaches them through one object, :class:`Extras` (``Run.extras``). It makes the pieces its
settings ask for, and its calls do nothing for the ones they do not: the standard recipe's path
meets one call at each point (before wrapping, in DDP's wrap, after the optimizer, after a step, in
the warm-up) and nothing else.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.config import Config


class Extras:
    """The extras of one run, each None unless its setting asks for it."""

    def __init__(self, cfg: Config, compiled: bool, bf16_weights: bool):
        self.cfg, self.compiled, self.bf16_weights = cfg, compiled, bf16_weights
        self.masters: MasterWeights | None = None
        """fp32 master weights behind bf16 working weights (train.param_dtype=bf16)."""
        self.lookahead: Lookahead | None = None

    def before_wrap(self, model: nn.Module) -> None:
        """bf16 weights and their masters: made before DDP sees the weights."""
        if self.bf16_weights:
            self.masters = MasterWeights(model, compiled=self.compiled)

    def ddp(self, net: nn.Module, model: nn.Module, world_size: int) -> bool:
        """In DDP's wrap: Linears that take their gradient from gathered factors (DDP leaves them
        alone); returns whether compiled graphs split at DDP's buckets."""
        d = self.cfg.dist
        if d.gather_linear_factors is not False and world_size > 1:
            gathered = gather_linear_factors(
                model, self.cfg.train.batch_size, world_size, force=bool(d.gather_linear_factors)
            )
            # their gradients arrive already summed over the ranks
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                net, [f"model.{n}.{k}" for n in gathered for k in ("weight", "bias")]
            )
        return split_at_buckets(model, d.split_graph_at_buckets, d.bucket_mb, world_size)

    def after_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.masters is not None:
            self.masters.attach(optimizer)
        if self.cfg.optim.lookahead_every:
            self.lookahead = Lookahead(model, self.cfg.optim.lookahead_every)

    def after_step(self, step: int, total: int) -> None:
        if self.lookahead is not None:
            self.lookahead.step(step, total)

    def warm_up(self, optimizer: torch.optim.Optimizer) -> bool:
        """Compile the master update before the clock starts; True if there was one."""
        if self.masters is not None:
            self.masters.warm_up(optimizer)
        return self.masters is not None

    def parts(self) -> dict:
        """Their checkpoint parts."""
        return {"masters": self.masters, "lookahead": self.lookahead}


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


def _sgd_on_masters(
    masters: list,
    weights: list,
    grads: list,
    buffers: list,
    lr: torch.Tensor,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
) -> None:
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
        self.named = [
            (n, p) for n, p in model.named_parameters() if p.requires_grad and p.ndim > 1 and p.dtype == torch.float32
        ]
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
                raise RuntimeError(
                    "a bf16 weight got no gradient this step; train.param_dtype=bf16 needs every weight used"
                )
            lr.fill_(group["lr"])  # a device scalar: the schedule changes it without recompiling
            self._update(
                masters, weights, grads, buffers, lr, group["momentum"], group["weight_decay"], group["nesterov"]
            )
            for w in weights:
                w.grad = None  # the optimizer's own step skips them

    @torch.no_grad()
    def warm_up(self, optimizer: torch.optim.Optimizer) -> None:
        """Compile the update before the clock starts, on scratch copies (the real state stays)."""
        for masters, weights, grads, buffers, lr, group in self._groups(optimizer, scratch=True):
            self._update(
                masters, weights, grads, buffers, lr, group["momentum"], group["weight_decay"], group["nesterov"]
            )


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
        if type(m) is nn.Linear and (
            force or m.in_features * m.out_features >= FACTOR_RATIO * (m.in_features + m.out_features) * global_batch
        ):
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
