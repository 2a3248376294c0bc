"""``trainer eval`` (a checkpoint's test accuracy) and ``trainer check`` (inputs, before launch)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer import checkpoint, data, models
from trainer.config import Config, ConfigError, from_dict, load_config


def preflight(cfg: Config) -> None:
    """The checks a launcher can make once, before torchrun starts any worker: CUDA where asked
    for, a writable checkpoint folder, a resume path that exists and fits, a data folder that holds
    data. Raises ConfigError (exit 2); changes nothing on disk."""
    has_cuda = torch.cuda.is_available()
    t = cfg.train
    if not has_cuda and (t.strategy in ("single", "dp") or t.device == "cuda"):
        what = f"train.strategy={t.strategy}" if t.strategy in ("single", "dp") else "train.device=cuda"
        raise ConfigError(f"{what} needs a CUDA GPU and none is visible; use train.strategy=cpu or train.device=auto")
    if cfg.dist.backend == "nccl" and (not has_cuda or t.device == "cpu"):
        raise ConfigError("dist.backend=nccl needs CUDA GPUs and this run is on the CPU; use dist.backend=gloo (or auto)")
    checkpoint.probe(Path(cfg.checkpoint.dir), 0)
    resume = cfg.checkpoint.resume
    existing = checkpoint.complete(Path(cfg.checkpoint.dir))
    if resume == "never" and existing:
        raise ConfigError(f"checkpoint.dir={cfg.checkpoint.dir} already holds checkpoints (newest {existing[-1][1].name}); use checkpoint.resume=auto, or another checkpoint.dir")
    folder = None if resume == "never" else (existing[-1][1] if resume == "auto" and existing else None)
    if resume not in ("auto", "never"):
        folder = Path(resume)
        if not folder.exists():
            raise ConfigError(f"checkpoint.resume={resume} does not exist; pass a step-N folder, or checkpoint.resume=auto")
        folder = folder if folder.is_dir() else folder.parent
    if folder is not None and (folder / checkpoint.META).is_file():
        saved = json.loads((folder / checkpoint.META).read_text()).get("model")
        if saved and saved != cfg.model.name:
            raise ConfigError(f"checkpoint {folder} holds model {saved!r} but model.name={cfg.model.name}; set model.name={saved} or use another checkpoint.dir")
    d = cfg.data
    if d.name == "imagefolder":
        if not Path(d.dir).is_dir():
            raise ConfigError(f"data.dir={d.dir} does not exist; create it or point data.dir at the data set")
        for split in ("train", "test"):
            data._find_source(Path(d.dir), split)
    elif d.name == "cifar10" and not d.download and not (Path(d.dir) / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"CIFAR-10 is not in data.dir={d.dir} and data.download=false; set data.download=true or point data.dir at it")


def evaluate_checkpoint(path: str, config_file: str | None, overrides) -> tuple[float, float, int]:
    """(test loss, test accuracy, test images) of the checkpoint at ``path``."""
    from trainer.dist import setup, teardown
    from trainer.loader import Augment
    from trainer.loop import evaluate
    from trainer.setup import Fast, _load_weights

    state = checkpoint.load(path)
    base = from_dict(state["config"])
    base.train.strategy = "auto"  # evaluate wherever we are, whatever the run used
    base.checkpoint.resume = "never"
    cfg = load_config(config_file, overrides, base=base)
    if cfg.train.strategy == "fsdp":
        cfg.train.strategy = "ddp"
    rt = setup(cfg)
    try:
        fast = Fast.resolve(cfg, rt)
        model = models.build(cfg.model.name)
        _load_weights(model, state, cfg, Path(path))
        model.to(rt.device)
        if fast.channels_last:
            model.to(memory_format=torch.channels_last)
        _, test_split = data.load(cfg)
        loss, acc = evaluate(model, test_split, cfg, rt, Augment(cfg, rt, fast.channels_last), fast.bf16)
        return loss, acc, len(test_split)
    finally:
        teardown()

