"""``trainer check``: every check of a run's input that needs no training, in one pass."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer.config import Config, ConfigError, check_devices
from trainer.worker import data, models, pretrained
from trainer.worker.checkpoint import folder as files
from trainer.worker.checkpoint.lock import FolderLock
from trainer.worker.checkpoint.parts import state_bytes


def resume_from(cfg: Config) -> Path | None:
    """The checkpoint folder a start resumes from (None: a fresh start), checked: one that is named
    exists, and its model and global batch fit. ConfigError (exit 2) otherwise. Cheap: the launcher
    asks it before it downloads or decodes anything."""
    root = cfg.checkpoint.root
    folder = files.explicit_resume(root, cfg.checkpoint.resume)
    if cfg.checkpoint.resume == "auto":
        folder = files.newest_complete(root)
    if folder is not None:
        folder = folder if folder.is_dir() else folder.parent
        if (folder / files.META).is_file():
            meta = json.loads((folder / files.META).read_text())
            if meta.get("model"):
                files.check_model(meta["model"], cfg.model.name, folder)
            files.check_global_batch(meta.get("batch_size"), cfg.train.batch_size, folder)
    return folder


def preflight(cfg: Config) -> None:
    """The checks a launcher can make once, before torchrun starts any worker: CUDA where asked
    for, a resume path that exists and fits (its model and global batch), a data folder that holds
    data the model can take, pretrained weights that are here (or downloaded) and fit the model;
    then this machine's part: a writable checkpoint folder with room for keep + 1 checkpoints, no
    other run holding it. The input comes first, so its error is the same
    on every machine. Raises ConfigError (exit 2); writes nothing but the folder and its lock file."""
    check_devices(cfg, torch.cuda.is_available())
    root = cfg.checkpoint.root
    folder = resume_from(cfg)
    d = cfg.data
    if d.name == "shards":
        from trainer.worker.data import shards

        shards.check(Path(d.dir))
    if d.name != "imagefolder" or Path(d.dir).is_dir():  # the size the model gets (a missing folder is said below)
        size = data.resolve_image_size(cfg)[0]
        if problem := models.input_problem(cfg.model.name, size):
            raise ConfigError(problem)
        if folder is None:  # a fresh start: the pretrained weights exist (fetched where they can be) and fit
            pretrained.check(cfg.model.name, cfg.model.weights, size)
    if d.name == "imagefolder":
        if not Path(d.dir).is_dir():
            raise ConfigError(f"data.dir={d.dir} does not exist; create it or point data.dir at the data set")
        for split in ("train", "test"):
            data.check_archive(data.find_source(Path(d.dir), split))
    elif d.name == "cifar10" and not d.download and not (Path(d.dir) / "cifar-10-batches-py").is_dir():
        raise ConfigError(
            f"CIFAR-10 is not in data.dir={d.dir} and data.download=false; set data.download=true or point data.dir "
            f"at it"
        )
    files.probe(root, state_bytes(cfg), cfg.checkpoint.keep)
    FolderLock(root).check()  # another live run writes there: exit 2 now, naming it
