"""The model registry: ``build(name, num_classes, image_size)`` returns a freshly initialised network:
one of this project's CIFAR networks (32x32 images; airnet and resnet18 take any size) or any
torchvision classification model by name, untrained, with the data's number of classes.
:func:`input_problem` tells, on the meta device (no memory, no time), whether a model takes images
of a given size."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

REGISTRY: dict[str, Callable[[int], nn.Module]] = {}


def register(name: str):
    def wrap(fn):
        REGISTRY[name] = fn
        return fn

    return wrap


def build(name: str, num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """A fresh network. torchvision's get imported only for a name outside REGISTRY (seconds of a
    start that CIFAR runs do not pay)."""
    if name in REGISTRY:
        return REGISTRY[name](num_classes)
    import torchvision.models

    name = name.removeprefix("torchvision.")
    if name in ("googlenet", "inception_v3"):  # one logits tensor out, as every other model gives
        return torchvision.models.get_model(
            name, weights=None, num_classes=num_classes, aux_logits=False, init_weights=False
        )
    try:  # the vision transformers size their position embedding by the image: tell them
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes, image_size=image_size)
    except TypeError:  # the convolutional ones take any size and no such argument
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


class ShapesOnly(torch.overrides.TorchFunctionMode):
    """Skips ``normal_`` while a model is built on the meta device: torch runs a meta tensor's
    normal_ through torch._refs, whose first call imports torch._dynamo (1.3 s of a restart on an
    H200 node, 3 s on a laptop's CPU, paid for nothing when the run does not compile)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.normal_:
            return args[0]
        return func(*args, **(kwargs or {}))


SIZES = {"seednet": (32, 32), "tinynet": (32, 32), "airnet": (9, None), "resnet18": (8, None)}
"""The image sizes (least, most) this project's networks take: their linear heads expect seednet's
and tinynet's 32 px feature maps; the others pool whatever is left."""


def input_problem(name: str, image_size: int, num_classes: int = 10) -> str | None:
    """Why ``name`` cannot take images of ``image_size`` (one line naming the fix), or None. This
    project's networks by :data:`SIZES`; torchvision's by one forward pass of two images on the meta
    device, shapes only (its python kernels import torch._dynamo, a second or more: paid by runs of
    torchvision models alone, which import torchvision anyway). An op without a meta kernel proves
    nothing, and passes."""
    if name in SIZES:
        least, most = SIZES[name]
        if image_size < least or (most is not None and image_size > most):
            return _cannot(name, image_size, ValueError(f"it takes {least} px" + ("" if most == least else " or more")))
        return None
    with torch.device("meta"), ShapesOnly():
        try:
            model = build(name, num_classes, image_size).eval()
        except (ValueError, AssertionError) as e:  # e.g. a ViT's patch size that does not divide the image
            return _cannot(name, image_size, e)
        try:
            with torch.no_grad():
                model(torch.empty(2, 3, image_size, image_size))
        except NotImplementedError:
            return None
        except (RuntimeError, ValueError, AssertionError, IndexError) as e:
            return _cannot(name, image_size, e)
    return None


def _cannot(name: str, image_size: int, e: BaseException) -> str:
    why = " ".join(str(e).split())[:120] or e.__class__.__name__
    fix = "data.image_size=32" if name in SIZES else "another data.image_size (224 fits every torchvision model)"
    return f"model.name={name} cannot take data.image_size={image_size} images ({why}); use {fix} or another model.name"


@register("seednet")
def seednet(num_classes: int = 10) -> nn.Module:
    """The article's network, layer for layer: no activations, about 604 M parameters (1.3 G of them
    in the first Linear), 21.35 G multiply-adds per image."""
    return nn.Sequential(
        nn.Sequential(
            nn.Conv2d(3, 32, 5, 1, 2),
            nn.Conv2d(32, 64, 5, 1, 2),
            nn.Conv2d(64, 512, 5, 1, 2),
            nn.MaxPool2d(2),
            nn.Conv2d(512, 1024, 5, 1, 2),
            nn.MaxPool2d(2),
            nn.Conv2d(1024, 2048, 5, 1, 2),
            nn.Conv2d(2048, 4096, 5, 1, 2),
            nn.MaxPool2d(2),
        ),
        nn.Sequential(nn.Flatten(), nn.Linear(4096 * 4 * 4, 5000), nn.Linear(5000, 64), nn.Linear(64, num_classes)),
    )


class _Basic(nn.Module):
    """ResNet's basic block: two 3x3 convs with batch norm, plus the input (1x1-projected when the
    shape changes). Attribute names are torchvision's, so checkpoints of either load in the other."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's ResNet-18 (same layers, names and initialisation) with the CIFAR stem: a 3x3
    stride-1 first conv and no max-pool, so 32x32 images keep their resolution into the first
    stage. Written out here because importing torchvision costs a start seconds (BENCHMARKS.md)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
        widths, cin = (64, 128, 256, 512), 64
        for i, cout in enumerate(widths, start=1):
            stride = 1 if i == 1 else 2
            setattr(self, f"layer{i}", nn.Sequential(_Basic(cin, cout, stride), _Basic(cout, cout, 1)))
            cin = cout
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():  # torchvision's initialisation; its replaced stem kept PyTorch's default
            if isinstance(m, nn.Conv2d) and m is not self.conv1:
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


@register("resnet18")
def resnet18(num_classes: int = 10) -> nn.Module:
    return ResNet18(num_classes)


@register("tinynet")
def tinynet(num_classes: int = 10) -> nn.Module:
    """A small CNN without batch norm, so that data-parallel runs equal single-process runs (tests)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        # 8x8 -> 2x2 by a fixed 4x4 average: adaptive pooling has no deterministic CUDA backward
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(4),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


# --------------------------------------------------------------------------------------------
# airnet: the speed recipe's network. Published techniques (Page's DAWNBench ResNet, tysam-code's
# hlb-cifar10, Jordan's airbench): a frozen 2x2 whitening conv initialised from the data and a GELU, three
# conv-pool-BN-GELU blocks with identity-initialised convs, BN with frozen scale, and a scaled,
# bias-free linear head.


class _Conv(nn.Conv2d):
    def __init__(self, cin: int, cout: int):
        super().__init__(cin, cout, kernel_size=3, padding=1, bias=False)
        with torch.no_grad():
            nn.init.dirac_(self.weight[: min(cin, cout)])  # start near the identity on cin channels


class _Norm(nn.BatchNorm2d):
    def __init__(self, ch: int):
        super().__init__(ch, eps=1e-12, momentum=0.4)
        self.weight.requires_grad_(False)  # scale stays 1: only the shift learns


class _Block(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(
            _Conv(cin, cout), nn.MaxPool2d(2), _Norm(cout), nn.GELU(), _Conv(cout, cout), _Norm(cout), nn.GELU()
        )


class AirNet(nn.Module):
    def __init__(self, num_classes: int = 10, widths: tuple[int, int, int] = (64, 256, 256), scale: float = 1 / 9):
        super().__init__()
        self.whiten = nn.Conv2d(3, 24, kernel_size=2, padding=0, bias=True)
        self.whiten.weight.requires_grad_(False)
        self.blocks = nn.Sequential(_Block(24, widths[0]), _Block(widths[0], widths[1]), _Block(widths[1], widths[2]))
        self.head = nn.Linear(widths[2], num_classes, bias=False)
        self.scale = scale

    @torch.no_grad()
    def init_from_data(self, images: torch.Tensor, eps: float = 5e-4) -> None:
        """Whitening filters: eigenvectors of the 2x2 patch covariance of normalised ``images``,
        scaled by 1/sqrt(eigenvalue), each with its negation (24 channels)."""
        x = images.float()
        patches = F.unfold(x, kernel_size=2).transpose(1, 2).reshape(-1, 12).double()
        patches = patches - patches.mean(0)
        cov = patches.T @ patches / len(patches)
        vals, vecs = torch.linalg.eigh(cov)
        filt = (vecs.T / torch.sqrt(vals + eps)[:, None]).float().reshape(12, 3, 2, 2)
        self.whiten.weight.copy_(torch.cat([filt, -filt]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.gelu(self.whiten(x)))
        x = F.adaptive_max_pool2d(x, 1).flatten(1)
        return self.head(x) * self.scale


@register("airnet")
def airnet(num_classes: int = 10) -> nn.Module:
    return AirNet(num_classes)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DataParallel, DistributedDataParallel and torch.compile wrappers, so
    that saved keys never start with ``module.`` or ``_orig_mod.``."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
