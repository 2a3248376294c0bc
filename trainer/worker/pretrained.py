"""Pretrained starts: ``model.weights`` resolved, fetched and loaded into a fresh model.

model.weights is a weights name of torchvision's (``DEFAULT``, ``IMAGENET1K_V2``, ...: `trainer
models` lists each model's) or a file: a state dict (.pth/.pt), a safetensors file, or a step-N
folder (or run folder) of this trainer. The classifier head is always rebuilt for the data's
classes; every other tensor must load, in its shape.

The head is found the same way for every model: the tensors whose shapes change with the number of
classes (two builds on the meta device, no memory, no time), so nothing here lists heads by model.

A name resolves through torch's hub cache ($TORCH_HOME/hub/checkpoints, under the file name
torchvision uses), so a node with no network trains from a file put there. Where the file is
absent, one process per machine downloads it with torch.hub's own download and hash check (the
file name's hash prefix, as torchvision's loader checks it) while the others wait on a lock.

The images are normalised as the weights were trained: a torchvision name by its transforms' mean
and std; a step-N folder by the mean and std that run used; a safetensors file of `trainer export`
by its JSON beside it; any other file by ImageNet's (torchvision's convention for state dicts).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.config import CIFAR_MODELS, ConfigError
from trainer.contract import one_line
from trainer.worker.data import IMAGENET_MEAN, IMAGENET_STD, machine_lock, norm_stats

FILE_SUFFIXES = (".pth", ".pt", ".safetensors")
AUX = re.compile(r"^(aux1|aux2|AuxLogits)\.")
"""googlenet's and inception_v3's auxiliary heads: in their published weights, never in a model
built here (one logits tensor out)."""


@dataclass(frozen=True)
class Weights:
    spec: str
    """model.weights as given."""
    kind: str
    """torchvision, file or checkpoint."""
    path: Path
    """The file or step-N folder (for a torchvision name: where the hub cache keeps it)."""
    mean: tuple[float, ...]
    std: tuple[float, ...]
    url: str = ""
    label: str = ""

    def describe(self) -> str:
        """For the start line: the weights and the normalisation they bring."""
        mean = ", ".join(f"{v:.3f}" for v in self.mean)
        std = ", ".join(f"{v:.3f}" for v in self.std)
        return f"weights {self.label or self.path} (normalised by mean {mean}, std {std})"


def hub_folder() -> Path:
    """Where torch's hub cache keeps downloaded weights ($TORCH_HOME/hub/checkpoints)."""
    import torch.hub

    return Path(torch.hub.get_dir()) / "checkpoints"


def is_file_spec(spec: str) -> bool:
    return spec.endswith(FILE_SUFFIXES) or "/" in spec or os.sep in spec or Path(spec).exists()


def resolve(model_name: str, spec: str) -> Weights | None:
    """What model.weights names, checked (a name the model has, a file that exists), without
    reading it. None when it is empty."""
    if not spec:
        return None
    if is_file_spec(spec):
        return _file(spec)
    name = model_name.removeprefix("torchvision.")
    if model_name in CIFAR_MODELS:
        also = f", or torchvision.{model_name} (torchvision's, which has)" if name in ("resnet18",) else ""
        raise ConfigError(
            f"model.weights={spec}: model.name={model_name} is this project's network and has no published weights; "
            f"give a file (a .pth or .safetensors state dict, or a step-N folder){also}"
        )
    import torchvision.models as tvm

    enum = tvm.get_model_weights(name)
    names = list(enum.__members__)
    short = spec.split(".")[-1] if spec.startswith(enum.__name__ + ".") else spec
    if short not in enum.__members__:
        raise ConfigError(
            f"model.weights={spec} is no weights name of {name}; it has {', '.join(names)} "
            "(or give a file: .pth, .safetensors or a step-N folder)"
        )
    w = enum[short]
    t = w.transforms()
    return Weights(
        spec, "torchvision", hub_folder() / os.path.basename(w.url), tuple(t.mean), tuple(t.std), w.url, str(w)
    )


def _file(spec: str) -> Weights:
    from trainer.worker.checkpoint import folder as files

    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"model.weights={spec} does not exist; give a .pth/.pt/.safetensors file, a step-N folder, "
            "or a weights name (`trainer models` lists each model's)"
        )
    if path.is_dir():
        path = files.given(path)
        if not (path / files.META).is_file():
            raise ConfigError(
                f"model.weights={spec} is a folder but no checkpoint of this trainer (no {files.META}); "
                "give a step-N folder, a run folder or a weights file"
            )
        mean, std = normalization_of(files.read_meta(path))
        return Weights(spec, "checkpoint", path, mean, std, label=str(path))
    if path.suffix not in FILE_SUFFIXES:
        raise ConfigError(
            f"model.weights={spec}: a weights file ends in {', '.join(FILE_SUFFIXES)}; give such a file or a step-N "
            f"folder"
        )
    mean, std = IMAGENET_MEAN, IMAGENET_STD
    sidecar = path.with_suffix(".json")
    if path.suffix == ".safetensors" and sidecar.is_file():  # `trainer export --format safetensors` wrote it
        import json

        about = json.loads(sidecar.read_text())
        mean, std = tuple(about.get("mean", mean)), tuple(about.get("std", std))
    return Weights(spec, "file", path, tuple(mean), tuple(std), label=str(path))


def normalization_of(meta: dict) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std a checkpoint's run normalised by (checkpoints before this was stored:
    the image size's defaults)."""
    if (norm := meta.get("normalize")) is not None:
        return tuple(norm["mean"]), tuple(norm["std"])
    size = ((meta.get("config") or {}).get("data") or {}).get("image_size") or 32
    return norm_stats(size)


def fetch(w: Weights) -> None:
    """A torchvision name's file into the hub cache, once per machine (the others wait on the
    lock, then find it). Where it cannot be downloaded: ConfigError naming the file, its URL and
    the folder to put it in."""
    if w.kind != "torchvision" or w.path.is_file():
        return
    import torch.hub

    folder = w.path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"model.weights={w.spec}: cannot make the weights folder {folder} ({e.strerror}); "
            "set TORCH_HOME to a writable folder"
        ) from None
    with machine_lock(folder, "weights"):
        if w.path.is_file():
            return
        prefix = torch.hub.HASH_REGEX.search(w.path.name)
        try:
            torch.hub.download_url_to_file(w.url, str(w.path), prefix.group(1) if prefix else None, progress=False)
        except (OSError, RuntimeError, ValueError) as e:  # no network (URLError is an OSError), or a hash mismatch
            why = one_line(getattr(e, "reason", e), 100)
            raise ConfigError(
                f"model.weights={w.spec}: {w.path.name} is not in {folder} and could not be downloaded ({why}); "
                f"download {w.url} where there is a network and put it in {folder} (TORCH_HOME moves that folder)"
            ) from None


def state_dict(w: Weights) -> dict:
    """The weights' tensors by the plain module's names (``module.`` and ``_orig_mod.`` dropped)."""
    import torch

    if w.kind == "checkpoint":
        from trainer.worker.checkpoint import store

        state = store.read(w.path, ("model",))["model"]
    elif w.path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ConfigError(
                f"model.weights={w.spec} is a safetensors file, which needs the safetensors package; "
                "pip install 'cluster-trainer[export]'"
            ) from None
        state = load_file(str(w.path))
    else:
        try:
            state = torch.load(w.path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever the file is, it is not a state dict torch reads safely
            why = one_line(e, 100)
            raise ConfigError(
                f"model.weights={w.spec} is not a state dict torch can read ({why}); give a .pth of tensors, "
                "a safetensors file or a step-N folder"
            ) from None
        for key in ("state_dict", "model", "model_state_dict"):  # the usual wrappers of training scripts
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(
            f"model.weights={w.spec} holds no state dict (a mapping of names to tensors); give the weights of a model"
        )
    return {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in state.items()}


@functools.cache
def head_keys(model_name: str, image_size: int) -> frozenset[str]:
    """The classifier head's tensors: those whose shapes change with the number of classes (found
    once per process: a fresh start's load and its optimizer both ask)."""
    import torch

    from trainer.worker import models

    with torch.device("meta"), models.ShapesOnly():
        a = models.build(model_name, 10, image_size).state_dict()
        b = models.build(model_name, 11, image_size).state_dict()
    return frozenset(k for k, v in a.items() if k not in b or b[k].shape != v.shape)


def fit(w: Weights, source: dict, target: dict, head: frozenset[str], model_name: str) -> dict:
    """The tensors of ``source`` to load into a model whose state dict is ``target`` (shapes
    only): all but the head's. ConfigError naming the first keys that do not fit."""
    missing = [k for k in target if k not in head and k not in source]
    shape = [
        f"{k} {tuple(source[k].shape)} given, {tuple(target[k].shape)} here"
        for k in target
        if k not in head and k in source and tuple(source[k].shape) != tuple(target[k].shape)
    ]
    extra = [k for k in source if k not in target and not AUX.match(k)]
    if missing or shape or extra:
        what = "; ".join(
            part
            for part in (
                f"shapes differ: {', '.join(shape[:2])}" if shape else "",
                f"missing: {', '.join(missing[:3])}" if missing else "",
                f"not in the model: {', '.join(extra[:3])}" if extra else "",
            )
            if part
        )
        raise ConfigError(
            f"model.weights={w.spec} does not fit model.name={model_name} beyond its head ({what}); "
            f"give weights of {model_name}, or the model.name they were trained as"
        )
    return {k: v for k, v in source.items() if k in target and k not in head}


def check(model_name: str, spec: str, image_size: int) -> Weights | None:
    """`trainer check`'s part: the weights exist (downloaded if they can be) and fit the model."""
    w = resolve(model_name, spec)
    if w is None:
        return None
    fetch(w)
    import torch

    from trainer.worker import models

    with torch.device("meta"), models.ShapesOnly():
        target = models.build(model_name, 10, image_size).state_dict()
    fit(w, state_dict(w), target, head_keys(model_name, image_size), model_name)
    return w


def load_into(model, w: Weights, model_name: str, image_size: int) -> None:
    """Every tensor of the weights but the head's into ``model`` (in place: device and layout stay)."""
    fetch(w)
    keep = fit(w, state_dict(w), model.state_dict(), head_keys(model_name, image_size), model_name)
    model.load_state_dict(keep, strict=False)
