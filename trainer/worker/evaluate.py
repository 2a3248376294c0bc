"""Test accuracy: ``evaluate()`` over the test split (each epoch's evaluation, with test-time
augmentation by ``predict()``), and ``trainer eval`` of a saved checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.config import Config
from trainer.config_loader import from_dict, load_config
from trainer.worker import data, models, pretrained
from trainer.worker.checkpoint import folder as files
from trainer.worker.checkpoint import store
from trainer.worker.checkpoint.parts import ModelPart
from trainer.worker.data import Split
from trainer.worker.data.loader import Augment, eval_batches
from trainer.worker.data.stream import Streamed
from trainer.worker.runtime import Runtime, all_reduce_sum, setup, teardown


@torch.no_grad()
def predict(model: torch.nn.Module, x: torch.Tensor, tta: str) -> torch.Tensor:
    """Logits, averaged over the mirror (tta=flip) and one-pixel shifts (flip_translate)."""

    def mirrored(v):
        out = model(v)
        return out if tta == "none" else 0.5 * (out + model(v.flip(3)))

    logits = mirrored(x)
    if tta == "flip_translate":
        padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
        logits = 0.5 * logits + 0.25 * (mirrored(padded[:, :, :-2, :-2]) + mirrored(padded[:, :, 2:, 2:]))
    return logits


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    split: Split,
    cfg: Config,
    rt: Runtime,
    augment: Augment,
    bf16: bool,
    beat=None,
    on_batch=None,
) -> tuple[float, float]:
    """(test loss, test accuracy). Each rank takes a contiguous shard and every rank runs the same
    number of batches (sharded models gather weights collectively), so every test image is counted
    exactly once whatever the world size. ``beat()`` after each batch tells the hang watchdog;
    ``on_batch(logits, labels)`` sees every batch in order (trainer eval --report)."""
    model.eval()
    sums = torch.zeros(3, device=rt.device, dtype=torch.float64)
    if isinstance(split, Split):
        batches = eval_batches(split, rt, cfg.data.eval_batch_size)
    else:  # streamed from the test shards
        from trainer.worker.data.stream import eval_batches as streamed

        batches = streamed(split, cfg, rt, cfg.data.eval_batch_size)
    for x, y in batches:
        with torch.autocast(rt.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = predict(model, augment.eval(x), cfg.train.tta).float()
        sums[0] += F.cross_entropy(logits, y, reduction="sum").double()
        sums[1] += (logits.argmax(1) == y).sum()
        sums[2] += len(y)
        if on_batch is not None:
            on_batch(logits, y)
        if beat is not None:
            beat()
    loss, correct, n = all_reduce_sum(rt, sums).tolist()
    return loss / n, correct / n


def evaluate_checkpoint(path: str, config_file: str | None, overrides, report_dir: str | None = None):
    """(checkpoint, test loss, test accuracy, test images, report or None) of the checkpoint at
    ``path`` (a step-N folder, a file in it, or a run folder: then its newest complete checkpoint);
    with ``report_dir``, the per-class report too (trainer/worker/report.py)."""
    from trainer.worker.run import Fast

    where, about, _ = store.open_checkpoint(files.given(Path(path)), verify=True)
    base = from_dict(about["config"])
    base.train.strategy = "auto"  # evaluate wherever we are, whatever the run used
    base.checkpoint.resume = "never"
    cfg = load_config(config_file, overrides, base=base)
    if cfg.train.strategy == "fsdp":
        cfg.train.strategy = "ddp"
    rt = setup(cfg)
    try:
        fast = Fast.resolve(cfg, rt)
        files.check_model(about.get("model"), cfg.model.name, where)
        plan = data.plan(cfg, None, 1)  # streamed if large
        cfg.data.image_size = plan.image_size  # the size the checkpoint was trained at (stored resolved)
        _, test_split = (None, Streamed(Path(cfg.data.dir), "test")) if plan.stream else data.load(cfg)
        files.check_classes(about.get("classes"), test_split.classes, where)
        model = models.build(cfg.model.name, len(about.get("classes") or test_split.classes), cfg.data.image_size)
        part = ModelPart(model, cfg.model.name)
        part.full = True
        part.load_state_dict(store.read(where, ("model",))["model"], where)
        model.to(rt.device)
        if fast.channels_last:
            model.to(memory_format=torch.channels_last)
        augment = Augment(cfg, rt, fast.channels_last, norm=pretrained.normalization_of(about))
        if report_dir is None:
            loss, acc = evaluate(model, test_split, cfg, rt, augment, fast.bf16)
            return str(where), loss, acc, len(test_split), None
        loss, acc, report = evaluate_with_report(model, test_split, cfg, rt, augment, fast.bf16)
        if rt.is_main:
            report.write(Path(report_dir))
        return str(where), loss, acc, len(test_split), report
    finally:
        teardown()


def evaluate_with_report(model, test_split, cfg: Config, rt: Runtime, augment: Augment, bf16: bool):
    """(test loss, test accuracy, the per-class report: trainer/worker/report.py), every rank's share counted."""
    from trainer.worker.data.loader import eval_shard
    from trainer.worker.report import Collector, merge

    collector = Collector(len(test_split.classes), eval_shard(len(test_split), rt).start, rt.device)
    loss, acc = evaluate(model, test_split, cfg, rt, augment, bf16, on_batch=collector)
    return loss, acc, merge(rt, collector, test_split.classes, image_names(test_split))


def image_names(split):
    """A test image's name by index: its file (or shard:key), where the set keeps them."""
    if isinstance(split, Streamed):
        return lambda i: f"{split.shards.root}/{split.shards.name(i)}"
    return split.paths.__getitem__ if split.paths else None
