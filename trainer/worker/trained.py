"""A trained model outside training, for ``trainer predict`` and ``trainer export``: opened from a
step-N folder, a run folder (its newest complete checkpoint) or a file ``trainer export`` wrote
(.onnx, .pt2, .safetensors with its JSON), with what a user needs to feed it: the class names,
the image size, and the mean and std the images are normalised by.

Every form takes the same input: float32 NCHW RGB images of image_size x image_size, scaled to
[0, 1] and normalised by (x - mean) / std, after the evaluation's resize (shorter side to
:func:`trainer.worker.data.store_size`, centre crop). The description of it travels with every
export (``about``), so a server needs nothing of this project.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError
from trainer.worker import data, models
from trainer.worker.checkpoint import folder as files

EXPORTS = (".onnx", ".pt2", ".safetensors")
META_KEY = "trainer"
"""The exports' metadata entry (ONNX metadata_props, the .pt2's extra file trainer.json, the
safetensors header) that holds :meth:`Trained.about` as JSON."""


@dataclass
class Trained:
    name: str
    """model.name it was trained as."""
    classes: list[str]
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: Path
    module: torch.nn.Module | None = None
    """A torch module (checkpoint, .pt2, .safetensors), or None for an ONNX file (``session``)."""
    session: Any = None
    """onnxruntime's InferenceSession of an ONNX file."""
    config: dict = field(default_factory=dict)
    """The run's config, where the source is a checkpoint (the test split for export's check)."""

    def about(self) -> dict:
        """What a server needs to feed the model, as every export stores it."""
        size, store = self.image_size, data.store_size(self.image_size)
        # this project's own: no torchvision name
        tv = None if self.name in models.REGISTRY else self.name.removeprefix("torchvision.")
        return {
            "model": self.name,
            "classes": self.classes,
            "image_size": size,
            "mean": list(self.mean),
            "std": list(self.std),
            "input": f"float32 [N, 3, {size}, {size}] RGB in [0, 1], then (x - mean) / std per channel",
            "resize": f"shorter side to {store} px (bilinear), then the centre {size} x {size}",
            "torchvision": {"name": tv, "kwargs": build_kwargs(tv, size)} if tv else None,
        }

    def to(self, device: torch.device) -> Trained:
        if self.module is not None:
            self.module.to(device)
        return self

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Images of 0-255 as the model takes them, on their device and in their layout (uint8 into
        a new float tensor; float in place)."""
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1) * 255
        inv_std = 1 / (torch.tensor(self.std, device=x.device).view(1, 3, 1, 1) * 255)
        return (x if x.is_floating_point() else x.float()).sub_(mean).mul_(inv_std)

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a normalised batch (float32 on the CPU for ONNX; any device a module is on)."""
        if self.session is not None:
            feed = {self.session.get_inputs()[0].name: x.detach().float().cpu().numpy()}
            return torch.from_numpy(self.session.run(None, feed)[0])
        return self.module(x)


def build_kwargs(name: str, image_size: int) -> dict:
    """The arguments besides num_classes that torchvision's get_model needs to build the model as
    this project does (trainer/worker/models.py: one logits tensor out; a ViT's image size)."""
    if name in ("googlenet", "inception_v3"):
        return {"aux_logits": False, "init_weights": False}
    return {"image_size": image_size} if name.startswith("vit_") else {}


def open_trained(source: str) -> Trained:
    """The model at ``source`` on the CPU, in eval mode. ConfigError (exit 2) for anything else."""
    path = Path(source)
    if not path.exists():
        raise ConfigError(
            f"{source} does not exist; give a step-N folder, a run folder or a file of trainer export "
            f"({', '.join(EXPORTS)})"
        )
    if path.is_dir():
        return _checkpoint(path)
    if path.suffix == ".pt2":
        return _pt2(path)
    if path.suffix == ".onnx":
        return _onnx(path)
    if path.suffix == ".safetensors":
        return _safetensors(path)
    raise ConfigError(
        f"{source} is not a checkpoint or an exported model; give a step-N folder, a run folder or a file of trainer "
        f"export "
        f"({', '.join(EXPORTS)})"
    )


def _checkpoint(path: Path) -> Trained:
    from trainer.worker import pretrained
    from trainer.worker.checkpoint import store

    path = files.given(path)
    if not (path / files.META).is_file():
        raise ConfigError(
            f"{path} is not a checkpoint and holds none (no {files.META}); give a step-N folder or the run folder of "
            f"trainer train"
        )
    folder, about, _ = store.open_checkpoint(path, verify=True)
    config = about.get("config") or {}
    size = (config.get("data") or {}).get("image_size") or 32
    mean, std = pretrained.normalization_of(about)
    name, classes = about["model"], list(about["classes"])
    model = models.build(name, len(classes), size)
    model.load_state_dict(store.read(folder, ("model",))["model"])
    return Trained(name, classes, size, mean, std, folder, module=model.eval(), config=config)


def _from_about(about: dict, path: Path, **kw) -> Trained:
    return Trained(
        about["model"],
        list(about["classes"]),
        int(about["image_size"]),
        tuple(about["mean"]),
        tuple(about["std"]),
        path,
        **kw,
    )


def _pt2(path: Path) -> Trained:
    extra = {f"{META_KEY}.json": ""}
    program = torch.export.load(str(path), extra_files=extra)
    if not extra[f"{META_KEY}.json"]:
        raise ConfigError(
            f"{path} was not written by trainer export (no {META_KEY}.json inside); export it with trainer export"
        )
    return _from_about(json.loads(extra[f"{META_KEY}.json"]), path, module=program.module())


def _onnx(path: Path) -> Trained:
    ort = needs("onnxruntime", "an ONNX file")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    if META_KEY not in meta:
        raise ConfigError(
            f"{path} was not written by trainer export (no '{META_KEY}' metadata); export it with trainer export"
        )
    return _from_about(json.loads(meta[META_KEY]), path, session=session)


def _safetensors(path: Path) -> Trained:
    load_file = needs("safetensors.torch", "a safetensors file").load_file
    sidecar = path.with_suffix(".json")
    if not sidecar.is_file():
        raise ConfigError(
            f"{path} has no {sidecar.name} beside it (trainer export writes both); give both files, or a checkpoint"
        )
    about = json.loads(sidecar.read_text())
    model = models.build(about["model"], len(about["classes"]), int(about["image_size"]))
    model.load_state_dict(load_file(str(path)))
    return _from_about(about, path, module=model.eval())


def needs(package: str, what: str):
    """An export library, or ConfigError naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(
            f"{what} needs the {package.split('.')[0]} package, which is not installed; pip install "
            f"'cluster-trainer[export]'"
        ) from None
