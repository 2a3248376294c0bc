from __future__ import annotations

import torch
import torch.distributed as dist

from trainer import models, parallel
from trainer.config import load_config
from trainer.dist import Runtime


def test_ddp_settings_reach_the_wrapper(tmp_path):
    """Each dist.* knob of the config reaches the DDP wrapper (a one-rank gloo group), and the
    wrapper takes images and labels and returns the loss."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    split = torch._dynamo.config.optimize_ddp
    try:
        rt = Runtime("ddp", 0, 0, 1, 1, torch.device("cpu"), None)
        for flag in (True, False):
            value = str(flag).lower()
            cfg = load_config(None, [f"dist.broadcast_buffers={value}", f"dist.static_graph={value}",
                                     f"dist.gradient_as_bucket_view={value}", f"dist.split_graph_at_buckets={value}", "dist.bucket_mb=7"])
            net = parallel.wrap(models.build("tinynet"), torch.nn.CrossEntropyLoss(), cfg, rt, compile_model=False, bf16=False)
            assert isinstance(net, torch.nn.parallel.DistributedDataParallel)
            sync = getattr(net, "forward_sync_buffers", getattr(net, "broadcast_buffers", None))  # the name of torch 2.14, or of 2.11
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
    bucket while backward runs; ResNet-18's 45 MB (under SPLIT_BUCKETS buckets) after one graph."""
    with torch.device("meta"):  # sizes only, no memory
        assert parallel.split_at_buckets(models.build("seednet"), None, 25)
        assert not parallel.split_at_buckets(models.build("resnet18"), None, 25)
        assert parallel.split_at_buckets(models.build("resnet18"), None, 1)  # 45 MB is many 1 MB buckets
        assert parallel.split_at_buckets(models.build("tinynet"), True, 25) and not parallel.split_at_buckets(models.build("seednet"), False, 25)
