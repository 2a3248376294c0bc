from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.config_loader import load_config
from trainer.worker.optim import build_optimizer, lr_factor, param_groups
from trainer.worker.speed import Lookahead


def test_biases_learn_faster_with_the_same_decay_per_step():
    cfg = load_config(None, ["optim.lr=0.5", "optim.weight_decay=0.01", "optim.bias_lr_scale=8"])
    groups = param_groups(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), cfg)
    weights, others = groups
    assert len(weights["params"]) == 1 and len(others["params"]) == 3
    assert others["lr"] == 4.0 and others["lr"] * others["weight_decay"] == pytest.approx(
        weights["lr"] * weights["weight_decay"]
    )


def test_triangle_and_cosine_schedules():
    tri = load_config(
        None,
        ["optim.schedule=triangle", "optim.warmup_epochs=2", "optim.warmup_start=0.2", "optim.final_lr_fraction=0"],
    )
    assert [lr_factor(tri, s, 100, 10) for s in (0, 10, 20, 60, 100)] == pytest.approx([0.2, 0.6, 1.0, 0.5, 0.0])
    cos = load_config(None, ["optim.schedule=cosine", "optim.warmup_epochs=0", "optim.final_lr_fraction=0.1"])
    assert [lr_factor(cos, s, 100, 10) for s in (0, 50, 100)] == pytest.approx([1.0, 0.55, 0.1])
    # past the end (a step count beyond the schedule's): the final rate, never a negative one
    assert lr_factor(tri, 130, 100, 10) == 0.0 and lr_factor(cos, 200, 100, 10) == pytest.approx(0.1)


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


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("momentum, nesterov, wd", [(0.0, False, 0.0), (0.9, False, 5e-4), (0.9, True, 5e-4)])
def test_bf16_weights_follow_torch_sgd_on_their_fp32_masters(compiled, momentum, nesterov, wd):
    """train.param_dtype=bf16: the masters take torch.optim.SGD's steps from the bf16 gradients
    (same lr schedule and momentum), and the working weights are the masters rounded to bf16 after
    every step; the optimizer holds the working weights and steps only the other parameters."""
    from trainer.worker.optim import build_schedule
    from trainer.worker.speed import MasterWeights

    torch.manual_seed(0)
    cfg = load_config(
        None,
        [
            f"optim.momentum={momentum}",
            f"optim.nesterov={str(nesterov).lower()}",
            f"optim.weight_decay={wd}",
            "optim.lr=0.1",
            "optim.schedule=cosine",
            "optim.warmup_epochs=0",
            "train.precision=bf16",
            "train.param_dtype=bf16",
        ],
    )
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    masters = MasterWeights(model, compiled=compiled)
    assert [p.dtype for p in model.parameters()] == [
        torch.bfloat16,
        torch.float32,
        torch.float32,
        torch.float32,
        torch.bfloat16,
        torch.float32,
    ]
    opt = build_optimizer(model, cfg, cuda=False)
    masters.attach(opt)
    schedule = build_schedule(opt, cfg, 4, 4)
    ref_opt = torch.optim.SGD(
        [{"params": [reference[i] for i in (0, 4)]}, {"params": [reference[i] for i in (1, 2, 3, 5)]}],
        lr=0.1,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=wd,
        foreach=False,
    )
    ref_schedule = build_schedule(ref_opt, cfg, 4, 4)
    masters.warm_up(opt)  # compiles on copies: nothing real moves
    assert all(torch.equal(masters.masters[n], reference[i]) for i, n in ((0, "0.weight"), (4, "3.weight")))
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(2, 3, 6, 6)).float().square().mean()
        loss.backward()
        for r, p in zip(reference, model.parameters(), strict=True):
            r.grad = p.grad.float()
        assert model[0].weight.grad.dtype == torch.bfloat16
        with torch._dynamo.config.patch(error_on_recompile=True):  # the warm-up compiled what the real steps call
            opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        ref_opt.step()
        ref_schedule.step()
        assert model[0].weight.grad is None  # the hook clears the bf16 gradients it used
        for i, name in ((0, "0.weight"), (4, "3.weight")):
            torch.testing.assert_close(masters.masters[name], reference[i], rtol=1e-6, atol=1e-7)
            assert torch.equal(dict(model.named_parameters())[name], masters.masters[name].bfloat16())
        for i in (1, 2, 3, 5):
            torch.testing.assert_close(list(model.parameters())[i], reference[i], rtol=1e-6, atol=1e-7)
    assert set(masters.momentum) == ({"0.weight", "3.weight"} if momentum else set())
    assert not any(opt.state.get(p) for _, p in masters.named)  # the masters' momentum has one home


def test_masters_are_a_checkpoint_part_of_their_own():
    """The fp32 masters and their momentum save and load as one part; without them (a checkpoint of
    an fp32 run) they start from the restored weights with zero momentum."""
    from trainer.worker.speed import MasterWeights

    cfg = load_config(None, ["optim.momentum=0.9", "train.precision=bf16", "train.param_dtype=bf16"])
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    masters = MasterWeights(model, compiled=False)
    opt = build_optimizer(model, cfg, cuda=False)
    masters.attach(opt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(5, 4)).float().sum().backward()
    opt.step()
    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in masters.state_dict().items()}
    assert set(saved["weights"]) == set(saved["momentum"]) == {"0.weight", "1.weight"}
    assert all(t.dtype == torch.float32 for v in saved.values() for t in v.values())
    for t in [*masters.masters.values(), *masters.momentum.values()]:
        t.zero_()
    masters.load_state_dict(saved)
    assert all(torch.equal(masters.masters[n], saved["weights"][n]) for n in saved["weights"])
    assert torch.equal(model[0].weight, saved["weights"]["0.weight"].bfloat16())  # the working copy follows
    masters.from_model()
    assert torch.equal(masters.masters["0.weight"], model[0].weight.float())
    assert all(not b.any() for b in masters.momentum.values())


def test_bf16_weights_are_refused_where_they_cannot_work():
    from trainer.config import ConfigError

    bad = {
        "train.precision=fp32": "train.precision=bf16",
        "train.strategy=fsdp": "use ddp",
        "optim.name=adamw": "optim.name=sgd",
        "optim.lookahead_every=5": "optim.lookahead_every=0",
    }
    for override, fix in bad.items():
        with pytest.raises(ConfigError, match=fix):
            load_config(None, ["train.param_dtype=bf16", override])


def test_the_removed_update_in_backward_key_is_ignored_with_a_warning():
    """Saved configs that still carry dist.update_in_backward load (it bought no speed; BENCHMARKS.md)."""
    assert not hasattr(load_config(None, ["dist.update_in_backward=true"]).dist, "update_in_backward")
