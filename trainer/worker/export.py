"""``trainer export SOURCE --format onnx|pt2|safetensors``: one file a user serves without this
project, each with what it takes as input (trainer/worker/trained.py: ``about``).

- onnx: torch's exporter (torch.export, then onnxscript), a dynamic batch; the class names, image
  size and normalisation in the model's metadata (key ``trainer``, JSON). Checked after writing:
  onnxruntime against PyTorch's logits on a batch of the run's test split.
- pt2: torch.export with a dynamic batch; the same JSON as the extra file trainer.json
  (``torch.export.load(path, extra_files={"trainer.json": ""})``).
- safetensors: the weights, and a JSON beside them: torchvision's models load them with
  ``torchvision.models.get_model(name, num_classes=N, **kwargs)`` and ``load_state_dict``.

Every export is opened again and checked against the source's logits before the command says it
is done; a difference beyond TOLERANCE is exit 1 (the file stays, for a look).
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import torch

from trainer.config import ConfigError
from trainer.worker.trained import META_KEY, Trained, needs, open_trained

FORMATS = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "pt2": (), "safetensors": ("safetensors.torch",)}
"""Each format and the libraries of the export extra it needs (checked before anything is read)."""
TOLERANCE = 1e-3
"""Largest |logit difference| allowed, relative to the largest |logit| (at least 1): fp32 kernels
of two runtimes differ by rounding, 1e-6 to 1e-5 of it measured on ResNet-18 and this project's
networks; a wrong graph differs by order 1."""
CHECK_BATCH = 64


class ExportMismatch(RuntimeError):
    """The written file's logits differ from the source's (exit 1)."""


def check_batch(model: Trained) -> tuple[torch.Tensor, str]:
    """A normalised batch of the run's test split (where the run's data is reachable here), else
    random images, and which it is."""
    from trainer.config_loader import from_dict

    if model.config:
        try:
            from trainer.worker import data

            cfg = from_dict(model.config)
            plan = data.plan(cfg, None, 1)
            cfg.data.image_size = plan.image_size
            if not plan.stream:
                images = data.load(cfg)[1].images[:CHECK_BATCH]
                o = (images.shape[-1] - model.image_size) // 2  # the centre crop, as evaluation takes it
                x = model.normalize(images[:, :, o : o + model.image_size, o : o + model.image_size])
                return x, f"{len(x)} images of the test split"
        except (ConfigError, OSError):
            pass
    g = torch.Generator().manual_seed(0)
    return torch.randn(
        CHECK_BATCH, 3, model.image_size, model.image_size, generator=g
    ), f"{CHECK_BATCH} random images (the run's data is not here)"


def write(model: Trained, fmt: str, out: Path, x: torch.Tensor) -> None:
    about = json.dumps(model.about())
    module = model.module.eval()
    batch = ({0: torch.export.Dim("batch", min=1, max=1 << 16)},)  # by position: models name their input differently
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(out), metadata={META_KEY: about})
        out.with_suffix(".json").write_text(json.dumps(model.about(), indent=1) + "\n")
    elif fmt == "pt2":
        program = torch.export.export(module, (x,), dynamic_shapes=batch)
        torch.export.save(program, str(out), extra_files={f"{META_KEY}.json": about})
    else:
        import onnx

        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its progress to stdout
            program = torch.onnx.export(module, (x,), dynamic_shapes=batch, dynamo=True, verbose=False)
        program.save(str(out))
        proto = onnx.load(str(out))
        onnx.helper.set_model_props(proto, {META_KEY: about})
        onnx.save(proto, str(out))


def export(source: str, fmt: str, out: str | None, say=print) -> Path:
    """Write SOURCE as FMT, check it, and say what was written."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    for package in FORMATS[fmt]:
        needs(package, f"--format {fmt}")
    model = open_trained(source)
    if model.module is None:
        raise ConfigError(f"{source} is an ONNX file; export from the checkpoint (a step-N folder or the run folder)")
    path = Path(out) if out else Path(f"{model.source.name if model.source.is_dir() else model.source.stem}.{fmt}")
    x, what = check_batch(model)
    t0 = time.perf_counter()
    write(model, fmt, path, x)
    took = time.perf_counter() - t0
    with torch.no_grad():
        want = model.logits(x)
        got = open_trained(str(path)).logits(x)
    diff = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    line = (
        f"{path}: {fmt}, {model.name}, {len(model.classes)} classes, {model.image_size} px, written in {took:.1f} s; "
        f"largest logit difference from PyTorch on {what}: {diff:.2e} (tolerance {TOLERANCE * scale:.1e})"
    )
    if diff > TOLERANCE * scale:
        raise ExportMismatch(
            line.replace("; largest", ": MISMATCH; largest")
            + "; the file is kept for a look; report it with the model's name"
        )
    say(line)
    return path
