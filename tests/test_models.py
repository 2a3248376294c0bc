from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainer.worker.models import REGISTRY, build, unwrap


def test_registry_names():
    assert {"seednet", "resnet18", "airnet", "tinynet"} <= set(REGISTRY)


def test_seednet_is_the_articles_network_layer_for_layer():
    with torch.device("meta"):
        net = build("seednet")
        x = torch.empty(1, 3, 32, 32)
        with FlopCounterMode(display=False) as counter:
            out = net(x)
    convs = [
        (m.in_channels, m.out_channels, m.kernel_size, m.padding) for m in net.modules() if isinstance(m, nn.Conv2d)
    ]
    assert convs == [
        (a, b, (5, 5), (2, 2)) for a, b in [(3, 32), (32, 64), (64, 512), (512, 1024), (1024, 2048), (2048, 4096)]
    ]
    linears = [(m.in_features, m.out_features) for m in net.modules() if isinstance(m, nn.Linear)]
    assert linears == [(65536, 5000), (5000, 64), (64, 10)]
    assert sum(isinstance(m, nn.MaxPool2d) for m in net.modules()) == 3
    assert not any(isinstance(m, (nn.ReLU, nn.GELU, nn.BatchNorm2d)) for m in net.modules())
    params = sum(p.numel() for p in net.parameters())
    assert 603e6 < params < 605e6
    assert out.shape == (1, 10)
    assert abs(counter.get_total_flops() / 2 - 21.35e9) < 0.01e9  # multiply-adds per image


def test_resnet18_has_the_cifar_stem():
    net = build("resnet18")
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)
    assert isinstance(net.maxpool, nn.Identity)
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_resnet18_is_torchvisions_layer_for_layer_and_loads_its_weights():
    """Ours is written out (no torchvision import at start-up): the same keys, shapes, outputs and
    initialisation as torchvision's ResNet-18 with the CIFAR stem, so checkpoints of either load."""
    import torchvision

    theirs = torchvision.models.resnet18(num_classes=10)
    theirs.conv1, theirs.maxpool = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity()
    ours = build("resnet18")
    mine, ref = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(ref) and all(mine[k].shape == ref[k].shape for k in ref)
    for k in ref:  # same initialisation: kaiming (fan_out) convs, unit batch norms, default stem and head
        if k.endswith("weight") and ref[k].dim() == 4:
            assert abs(mine[k].std().item() / ref[k].std().item() - 1) < 0.2, k
        if k.endswith(("bn1.weight", "bn2.weight", "running_var")):
            assert torch.equal(mine[k], ref[k]), k
    ours.load_state_dict(ref)
    ours.eval(), theirs.eval()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours.train()(x).sum(), theirs.train()(x).sum())


def test_airnet_whitening_decorrelates_patches():
    torch.manual_seed(0)
    net = build("airnet")
    base = torch.randn(256, 1, 32, 32)
    images = torch.cat([base, 0.5 * base + 0.5 * torch.randn(256, 1, 32, 32), torch.randn(256, 1, 32, 32)], 1)
    net.init_from_data(images)
    with torch.no_grad():
        y = nn.functional.conv2d(images, net.whiten.weight)[:, :12]
    cov = torch.cov(y.permute(1, 0, 2, 3).reshape(12, -1))
    assert torch.allclose(cov, torch.eye(12), atol=0.05)
    assert not net.whiten.weight.requires_grad
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_unwrap_removes_dataparallel_and_compile_wrappers():
    net = build("tinynet")
    wrapped = torch.compile(nn.DataParallel(net))
    assert unwrap(wrapped) is net
    keys = unwrap(wrapped).state_dict().keys()
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in keys)


def test_torchvision_models_by_name_with_the_datas_classes():
    from trainer.worker.models import input_problem

    net = build("resnet50", num_classes=12, image_size=64)
    assert net.fc.out_features == 12 and type(net).__module__.startswith("torchvision")
    assert build("torchvision.resnet18", 5).conv1.stride == (2, 2)  # torchvision's stem, beside the CIFAR resnet18
    assert build("resnet18", 5).conv1.stride == (1, 1)
    vit = build("vit_b_16", num_classes=3, image_size=96)  # a ViT sized for the data's images
    assert vit.image_size == 96 and vit(torch.randn(1, 3, 96, 96)).shape == (1, 3)
    assert input_problem("resnet50", 64) is None and input_problem("vit_b_16", 96) is None
    problem = input_problem("seednet", 64)
    assert (
        problem.startswith("model.name=seednet cannot take data.image_size=64 images (")
        and "use data.image_size=32" in problem
    )
    assert "\n" not in input_problem("vit_b_16", 100)  # 16 px patches do not tile 100 px
