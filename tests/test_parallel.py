from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import BF16_DDP, DDP_12_STEPS

from trainer.config_loader import load_config
from trainer.worker import models, parallel, speed
from trainer.worker.runtime import Runtime


def test_ddp_settings_reach_the_wrapper(tmp_path):
    """Each dist.* knob of the config reaches the DDP wrapper (a one-rank gloo group), and the
    wrapper takes images and labels and returns the loss."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    split = torch._dynamo.config.optimize_ddp
    try:
        rt = Runtime("ddp", 0, 0, 1, torch.device("cpu"), None)
        for flag in (True, False):
            value = str(flag).lower()
            cfg = load_config(
                None,
                [
                    f"dist.broadcast_buffers={value}",
                    f"dist.static_graph={value}",
                    f"dist.gradient_as_bucket_view={value}",
                    f"dist.split_graph_at_buckets={value}",
                    "dist.bucket_mb=7",
                ],
            )
            net = parallel.wrap(
                models.build("tinynet"),
                torch.nn.CrossEntropyLoss(),
                cfg,
                rt,
                compile_model=False,
                bf16=False,
                extras=speed.Extras(cfg, False, False),
            )
            assert isinstance(net, torch.nn.parallel.DistributedDataParallel)
            # the name of torch 2.14, or of 2.11
            sync = getattr(net, "forward_sync_buffers", getattr(net, "broadcast_buffers", None))
            assert (sync, net.static_graph, net.gradient_as_bucket_view) == (flag, flag, flag)
            assert net.bucket_bytes_cap == 7 * 1024 * 1024
            assert torch._dynamo.config.optimize_ddp is flag  # dynamo splits compiled DDP at buckets, or not
            x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
            loss = net(x, y)  # the model and its loss in one module
            assert loss.shape == () and torch.allclose(loss, torch.nn.functional.cross_entropy(net.module.model(x), y))
    finally:
        torch._dynamo.config.optimize_ddp = split
        dist.destroy_process_group()


def test_compiled_ddp_splits_its_graph_only_for_large_gradients():
    """dist.split_graph_at_buckets=auto: seednet's 2.4 GB of gradients are all-reduced bucket by
    bucket while backward runs; ResNet-18's 45 MB (under SPLIT_BUCKETS buckets) after one graph,
    and so is everything in one process, which has no all-reduce to hide."""
    with torch.device("meta"):  # sizes only, no memory
        assert speed.split_at_buckets(models.build("seednet"), None, 25, world_size=2)
        assert not speed.split_at_buckets(models.build("resnet18"), None, 25, world_size=2)
        assert speed.split_at_buckets(models.build("resnet18"), None, 1, world_size=2)  # 45 MB is many 1 MB buckets
        # one process: nothing to overlap
        assert not speed.split_at_buckets(models.build("seednet"), None, 25, world_size=1)
        assert speed.split_at_buckets(models.build("tinynet"), True, 25, world_size=1) and not speed.split_at_buckets(
            models.build("seednet"), False, 25, world_size=2
        )


def test_linear_layers_gather_factors_only_where_that_sends_fewer_values():
    from trainer.worker.models import build
    from trainer.worker.speed import GatheredFactorsLinear, gather_linear_factors

    with torch.device("meta"):  # seednet's shapes without its 2.4 GB
        net = build("seednet")
    # the first Linear (65,536 x 5,000): 9.0 M values as factors at a global batch of 128, 328 M as a gradient
    assert gather_linear_factors(net, global_batch=128, world=2) == ["1.1"]
    assert isinstance(net[1][1], GatheredFactorsLinear) and net[1][1].world == 2 and type(net[1][2]) is torch.nn.Linear
    with torch.device("meta"):
        # 72 M against 328 M: not worth the break
        assert gather_linear_factors(build("seednet"), global_batch=1024, world=2) == []
    # 2,048 x 10: the gradient is smaller
    assert gather_linear_factors(build("tinynet"), global_batch=32, world=2) == []
    assert gather_linear_factors(build("tinynet"), global_batch=32, world=2, force=True) == ["10"]


def test_a_gathered_linear_stays_out_of_the_compiled_graphs():
    from trainer.worker.models import build
    from trainer.worker.speed import gather_linear_factors

    def linears_compiled(net) -> int:
        found = []

        def backend(gm, example_inputs):
            found.extend(n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(net.eval(), backend=backend)(torch.zeros(2, 3, 32, 32))
        return len(found)

    torch.manual_seed(0)
    assert linears_compiled(build("tinynet")) == 1
    net = build("tinynet")
    gather_linear_factors(net, global_batch=32, world=2, force=True)
    assert linears_compiled(net) == 0  # its collectives run eagerly, between the graphs


@pytest.mark.parametrize(
    "overrides, rtol",
    [
        ([*DDP_12_STEPS, "optim.momentum=0.9"], 1e-5),  # fp32: the same sums in another order
        # bf16 weights: the gathered layer's bf16 gradient is rounded once (after the sum) instead of per
        # rank: some bf16 weights round the other way, and 12 steps later the momentum differs by about
        # 1% (a gradient taken twice, or not averaged, is 50-100%)
        ([*BF16_DDP, "optim.momentum=0.9"], 5e-2),
    ],
    ids=["fp32", "bf16-weights"],
)
def test_linear_gradients_from_gathered_factors_match_ddps_all_reduce(tmp_path, overrides, rtol):
    """dist.gather_linear_factors=true (every Linear) against DDP's all-reduce, two ranks (gloo):
    the same training up to float rounding, forward and backward through channels-last convs."""
    from conftest import TINY, same_training

    same_training(tmp_path, [*TINY, *overrides], "dist.gather_linear_factors", rtol=rtol)
