from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.config import load_config
from trainer.optim import Lookahead, build_optimizer, lr_factor, param_groups


def test_biases_learn_faster_with_the_same_decay_per_step():
    cfg = load_config(None, ["optim.lr=0.5", "optim.weight_decay=0.01", "optim.bias_lr_scale=8"])
    groups = param_groups(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), cfg)
    weights, others = groups
    assert len(weights["params"]) == 1 and len(others["params"]) == 3
    assert others["lr"] == 4.0 and others["lr"] * others["weight_decay"] == pytest.approx(weights["lr"] * weights["weight_decay"])


def test_triangle_and_cosine_schedules():
    tri = load_config(None, ["optim.schedule=triangle", "optim.warmup_epochs=2", "optim.warmup_start=0.2", "optim.final_lr_fraction=0"])
    assert [lr_factor(tri, s, 100, 10) for s in (0, 10, 20, 60, 100)] == pytest.approx([0.2, 0.6, 1.0, 0.5, 0.0])
    cos = load_config(None, ["optim.schedule=cosine", "optim.warmup_epochs=0", "optim.final_lr_fraction=0.1"])
    assert [lr_factor(cos, s, 100, 10) for s in (0, 50, 100)] == pytest.approx([1.0, 0.55, 0.1])


def test_lookahead_pulls_the_fast_weights_to_the_slow_average():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    la = Lookahead(model, every=2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model(torch.randn(8, 3))  # batch-norm statistics and num_batches_tracked move too
    moved = {k: v.clone() for k, v in model.state_dict().items()}
    la.step(1, 10)  # not a multiple of `every`: nothing happens
    assert all(torch.equal(model.state_dict()[k], moved[k]) for k in moved)
    la.step(10, 10)
    a = 1 - 0.95**2  # progress 1: slow <- slow + a (fast - slow)
    for k, v in model.state_dict().items():
        if v.dtype.is_floating_point:
            torch.testing.assert_close(v, start[k] + a * (moved[k] - start[k]))
            torch.testing.assert_close(la.state_dict()[k], v)
        else:
            assert torch.equal(v, moved[k]) and torch.equal(la.state_dict()[k], moved[k])


def test_fused_optimizer_needs_cuda():
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="optim.impl=foreach"):
        build_optimizer(nn.Linear(2, 2), load_config(None, ["optim.impl=fused"]), cuda=False)
