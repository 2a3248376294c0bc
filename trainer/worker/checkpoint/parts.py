"""What a checkpoint holds: parts, each with ``state_dict()`` and ``load_state_dict()`` and each
the one owner of its state (the model, the optimizer, and beside them the bf16 weights' fp32
masters, the schedule, Lookahead and the loop's counters).

The model and the optimizer go through ``torch.distributed.checkpoint.state_dict``, the same
calls for every strategy: the plain module's names (no ``module.``/``_orig_mod.`` prefix), and
optimizer state keyed by parameter name, so that a checkpoint of any strategy and world size
resumes under any other. Under fsdp each rank's state is its shard (DTensors), which DCP writes
and reshards; ``full`` parts give and take whole tensors (a checkpoint of format 1, ``trainer eval``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from trainer.config import Config
from trainer.worker import models
from trainer.worker.checkpoint.folder import CheckpointError
from trainer.worker.models import unwrap


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainState:
    """The loop's counters (saved at the top level of a checkpoint)."""

    epoch: int = 0
    """Epoch in progress (epochs finished so far)."""
    epoch_step: int = 0
    """Steps finished inside that epoch: a resumed run skips these global batches."""
    step: int = 0
    """Optimizer steps finished in all."""

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "epoch_step": self.epoch_step, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.epoch_step, self.step = state["epoch"], state["epoch_step"], state["step"]


def _options(full: bool, strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # no cpu_offload: a GPU tensor goes to host memory once, in the save's own (pinned) copy
    return StateDictOptions(full_state_dict=full, strict=strict)


class ModelPart:
    """The model's weights and buffers."""

    full = False
    """Whole tensors (gathered under fsdp, where every rank must call) instead of each rank's shard."""

    def __init__(self, model: nn.Module, name: str):
        self.model, self.name = unwrap(model), name
        # Imported while the run is built, not at its first use: the import costs about 0.2 s on
        # an H200 node, which the first step's reserve() would otherwise add to epoch 0 (the speed
        # recipe's 1.70 s became 1.90 s). Not at module level: `trainer check` needs none of it.
        import torch.distributed.checkpoint.state_dict  # noqa: F401

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=_options(self.full))

    def load_state_dict(self, state: dict, where: Path | str = "checkpoint") -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        try:
            # copies into the live tensors: their layout stays
            set_model_state_dict(self.model, dict(state), options=_options(self.full))
        except (RuntimeError, KeyError) as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            detail = lines[1] if len(lines) > 1 else (lines[0] if lines else repr(e))
            raise CheckpointError(
                f"checkpoint {where} does not fit model {self.name} ({detail}); use a checkpoint of this model"
            ) from None


class OptimizerPart:
    """The optimizer's state and param groups, by parameter name."""

    full = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = unwrap(model), optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # An optimizer without state yet (SGD without momentum) first takes one step of zero
        # gradients at lr 0 inside torch: nothing moves.
        return get_optimizer_state_dict(self.model, self.optimizer, options=_options(self.full))

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's state per parameter, under this run's settings: a resume with other
        optim settings (momentum switched off or on, another weight decay) runs with the new ones,
        as a part switched on later (Lookahead) starts afresh. The learning rate stays the
        schedule's."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if len(state["param_groups"]) != len(self.optimizer.param_groups):
            raise CheckpointError(
                f"the checkpoint's optimizer has {len(state['param_groups'])} parameter groups, this run's "
                f"{len(self.optimizer.param_groups)}; resume with the optim settings it was saved with"
            )
        settings = [
            {k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in self.optimizer.param_groups
        ]
        stateless = isinstance(self.optimizer, torch.optim.SGD) and not any(
            g["momentum"] for g in self.optimizer.param_groups
        )
        if stateless or not any(
            isinstance(v, torch.Tensor) for per_param in state["state"].values() for v in per_param.values()
        ):
            # Nothing per parameter to restore (SGD without momentum, as seed.yaml, now or when
            # saved): torch's loader learns the device from state tensors and fails without any
            # ("Expected device to be set"). The saved groups give the schedule's learning rate;
            # the rest of their settings are this run's again just below.
            for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        else:
            # not strict: parameters with no state of their own (bf16 weights: their masters' momentum
            # is the masters' part) or none yet (a momentum-free group) are legitimate
            set_optimizer_state_dict(self.model, self.optimizer, state, options=_options(self.full, strict=False))
            self._match_parameters()
        for group, own in zip(self.optimizer.param_groups, settings, strict=True):
            group.update(own)

    @torch.no_grad()
    def _match_parameters(self) -> None:
        """Per-parameter state (momentum, Adam's moments) in its parameter's exact layout.
        ``Optimizer.load_state_dict`` keeps the strides the tensors were saved with; a checkpoint
        written by an older version (or by another memory format) would then hand the fused kernels
        a channels-last weight with a contiguous momentum buffer, which they refuse."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and v.stride() != p.stride():
                        self.optimizer.state[p][key] = torch.empty_like(p, dtype=v.dtype).copy_(v)


def state_bytes(cfg: Config) -> int:
    """Bytes of one checkpoint: the weights, plus one copy per optimizer state tensor and Lookahead,
    plus half for bf16 working weights beside their fp32 masters (the upper bound under auto)."""
    with torch.device("meta"), models.ShapesOnly():  # shapes only: no memory, no time
        # the head's classes: a rounding error of the size
        model = models.build(cfg.model.name, 10, cfg.data.image_size or 32)
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    copies = 1 + (2 if cfg.optim.name == "adamw" else int(cfg.optim.momentum > 0)) + int(cfg.optim.lookahead_every > 0)
    return int(n * (copies + 0.5 * (cfg.train.param_dtype != "fp32")))
