"""Run by tests/test_resume.py and tests/test_gpu.py, alone or under torchrun: train with the real
build() and Trainer, and write (rank 0) what a resume must reproduce, tensor for tensor.

    python tests/resume_probe.py OUT key=value...      # or: torchrun ... tests/resume_probe.py OUT ...

OUT gets ``restored`` (the layout of every live tensor right after build(): the model's
parameters and buffers, the optimizer's per-parameter state, bf16 weights' masters, Lookahead's copies), ``final``
(the same at the end), ``values`` (the final saved state, flattened per key) and ``resumed``.
A layout is (dtype, device type, shape, strides).
"""

from __future__ import annotations

import sys

import torch

from trainer.config_loader import load_config
from trainer.worker.loop import Trainer
from trainer.worker.models import unwrap
from trainer.worker.run import build
from trainer.worker.runtime import setup, teardown


def layout(t: torch.Tensor) -> tuple:
    return (str(t.dtype), t.device.type, tuple(t.shape), tuple(t.stride()))


def live_layout(run) -> dict[str, tuple]:
    model = unwrap(run.model)
    out = {f"model/{k}": layout(v) for k, v in model.state_dict(keep_vars=True).items()}
    names = {id(p): n for n, p in model.named_parameters()}
    masters, lookahead = run.extras.masters, run.extras.lookahead
    if masters:  # train.param_dtype=bf16: the fp32 masters and their momentum
        out.update(
            {f"masters/{kind}/{n}": layout(t) for kind, ts in masters.state_dict().items() for n, t in ts.items()}
        )
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            for key, v in run.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out[f"optimizer/{names[id(p)]}/{key}"] = layout(v)
    if lookahead is not None:
        out.update({f"lookahead/{n}": layout(s) for n, s in zip(lookahead.names, lookahead.slow, strict=True)})
    return out


def flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, torch.Tensor):
            out[key] = v.detach().to("cpu", copy=True).contiguous()
        elif isinstance(v, dict):
            out.update(flat(v, key))
    return out


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(None, overrides)
    rt = setup(cfg)
    run = build(cfg, rt)
    restored = live_layout(run)
    code = Trainer(run).fit()
    final = live_layout(run)
    parts = run.checkpointer.parts
    for part in parts.values():
        part.full = True  # whole tensors (the model's and optimizer's parts: a collective under fsdp)
    state = {k: p.state_dict() for k, p in parts.items()}
    if rt.is_main:
        values = flat({k: state[k] for k in ("model", "optimizer", "masters", "lookahead") if state.get(k) is not None})
        torch.save(
            {
                "restored": restored,
                "final": final,
                "values": values,
                "resumed": run.resumed_from is not None,
                "step": run.state.step,
                "code": code,
            },
            out,
        )
    run.checkpointer.close()
    teardown()


if __name__ == "__main__":
    main()
