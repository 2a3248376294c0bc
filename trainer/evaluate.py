"""``trainer eval`` (a checkpoint's test accuracy) and ``trainer check`` (inputs, before launch)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer import checkpoint, data, models
from trainer.config import Config, ConfigError, check_devices, from_dict, load_config


def preflight(cfg: Config) -> None:
    """The checks a launcher can make once, before torchrun starts any worker: CUDA where asked
    for, a writable checkpoint folder, a resume path that exists and fits, a data folder that holds
    data, room for keep + 1 checkpoints, no other run holding the folder. Raises ConfigError (exit
    2); writes nothing but the folder itself and its lock file."""
    check_devices(cfg, torch.cuda.is_available())
    root = Path(cfg.checkpoint.dir)
    with torch.device("meta"):  # shapes only: no memory, no time
        shapes = models.build(cfg.model.name)
    checkpoint.probe(root, checkpoint.state_bytes(shapes, cfg), cfg.checkpoint.keep)
    checkpoint.FolderLock(root).check()  # another live run writes there: exit 2 now, naming it
    folder = checkpoint.explicit_resume(root, cfg.checkpoint.resume)
    if cfg.checkpoint.resume == "auto":
        folder = checkpoint.newest_complete(root)
    if folder is not None:
        folder = folder if folder.is_dir() else folder.parent
        if (folder / checkpoint.META).is_file():
            saved = json.loads((folder / checkpoint.META).read_text()).get("model")
            if saved:
                checkpoint.check_model(saved, cfg.model.name, folder)
    d = cfg.data
    if d.name == "imagefolder":
        if not Path(d.dir).is_dir():
            raise ConfigError(f"data.dir={d.dir} does not exist; create it or point data.dir at the data set")
        for split in ("train", "test"):
            data.check_archive(data._find_source(Path(d.dir), split))
    elif d.name == "cifar10" and not d.download and not (Path(d.dir) / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"CIFAR-10 is not in data.dir={d.dir} and data.download=false; set data.download=true or point data.dir at it")


def evaluate_checkpoint(path: str, config_file: str | None, overrides) -> tuple[str, float, float, int]:
    """(checkpoint, test loss, test accuracy, test images) of the checkpoint at ``path`` (a step-N
    folder, its state.pt, or a run folder: then its newest complete checkpoint)."""
    from trainer.dist import setup, teardown
    from trainer.loader import Augment
    from trainer.loop import evaluate
    from trainer.setup import Fast

    folder = Path(path)
    if folder.is_dir() and not (folder / checkpoint.STATE).exists() and (newest := checkpoint.newest_complete(folder)) is not None:
        path = str(newest)  # a run folder: its newest complete checkpoint
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
        checkpoint.check_model(state.get("model_name"), cfg.model.name, Path(path))
        checkpoint.ModelPart(model, "single", cfg.model.name).load_state_dict(state["model"], path)
        model.to(rt.device)
        if fast.channels_last:
            model.to(memory_format=torch.channels_last)
        _, test_split = data.load(cfg)
        loss, acc = evaluate(model, test_split, cfg, rt, Augment(cfg, rt, fast.channels_last), fast.bf16)
        return str(path), loss, acc, len(test_split)
    finally:
        teardown()

