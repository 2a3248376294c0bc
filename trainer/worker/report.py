"""``trainer eval SOURCE --report DIR``: what a person looks at after a run. Per class: images,
accuracy (recall), precision, F1 (a table on the console, per_class.csv); the confusion matrix as
a picture (confusion.png: rows normalised, labels where they fit, readable at 10 classes and at
100); the most confused pairs (confused_pairs.csv); the worst-predicted test images by path
(worst.csv: the lowest probability given to the true class).

Distributed-exact as evaluation is: each rank counts its contiguous share of the test split into
a confusion matrix that is summed across ranks (integers), and keeps its worst images with their
global index; rank 0 merges and writes.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

WORST = 25
PAIRS = 10
LABELS_FIT = 40
"""At most this many class names along an axis of the picture; past it every k-th is shown."""


@dataclass
class Collector:
    """Fed each evaluation batch's logits and labels in order (this rank's share of the test split)."""

    num_classes: int
    start: int
    """The global index of this rank's first test image."""
    device: torch.device
    confusion: torch.Tensor = field(init=False)
    worst: list = field(default_factory=list)
    seen: int = 0

    def __post_init__(self):
        self.confusion = torch.zeros(self.num_classes * self.num_classes, dtype=torch.int64, device=self.device)

    def __call__(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        if not len(y):
            return
        probs = logits.float().softmax(1)
        pred = probs.argmax(1)
        self.confusion += torch.bincount(y * self.num_classes + pred, minlength=self.num_classes**2)
        p_true = probs.gather(1, y[:, None])[:, 0]
        k = min(WORST, len(y))
        low, at = p_true.topk(k, largest=False)
        self.worst += [
            (p, self.start + self.seen + i, int(y[i]), int(pred[i]))
            for p, i in zip(low.tolist(), at.tolist(), strict=True)
        ]
        self.worst = sorted(self.worst)[:WORST]
        self.seen += len(y)


@dataclass
class Report:
    classes: list[str]
    confusion: torch.Tensor
    """[true, predicted] counts over the whole test split."""
    worst: list
    """(probability of the true class, test index, true, predicted), lowest first."""
    name_of: Callable[[int], str] | None
    """A test image's path (or shard:key) by its index, where the set has them."""

    def per_class(self) -> list[dict]:
        c = self.confusion.double()
        tp, support, predicted = c.diag(), c.sum(1), c.sum(0)
        rows = []
        for i, name in enumerate(self.classes):
            recall = (tp[i] / support[i]).item() if support[i] else float("nan")
            precision = (tp[i] / predicted[i]).item() if predicted[i] else float("nan")
            f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
            rows.append(
                {
                    "class": name,
                    "images": int(support[i]),
                    "accuracy": recall,
                    "precision": precision,
                    "recall": recall,
                    "f1": f1,
                }
            )
        return rows

    def pairs(self) -> list[tuple[str, str, int, float]]:
        c = self.confusion.clone()
        c.fill_diagonal_(0)
        support = self.confusion.sum(1).clamp(min=1)
        flat = c.flatten()
        k = min(PAIRS, int((flat > 0).sum()))
        counts, at = flat.topk(k)
        n = len(self.classes)
        return [
            (self.classes[i // n], self.classes[i % n], int(v), int(v) / int(support[i // n]))
            for v, i in zip(counts.tolist(), at.tolist(), strict=True)
        ]

    def table(self) -> str:
        width = max(5, *(len(c) for c in self.classes))
        lines = [f"{'class'.ljust(width)}  images  accuracy (recall)  precision     f1"]
        for r in self.per_class():
            lines.append(
                f"{r['class'].ljust(width)}  {r['images']:>6}  {100 * r['accuracy']:>15.2f}%  "
                f"{100 * r['precision']:>8.2f}%  {r['f1']:.3f}"
            )
        total = self.confusion.sum().item()
        lines.append(
            f"{'all'.ljust(width)}  {total:>6}  {100 * self.confusion.diag().sum().item() / max(1, total):>15.2f}%"
        )
        if pairs := self.pairs():
            lines.append(
                "most confused: " + "; ".join(f"{t} -> {p} {n} ({100 * s:.1f}% of {t})" for t, p, n, s in pairs[:5])
            )
        return "\n".join(lines)

    def write(self, out: Path) -> list[Path]:
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "per_class.csv", out / "confused_pairs.csv", out / "worst.csv", out / "confusion.png"]
        with written[0].open("w", newline="") as fh:
            w = csv.DictWriter(fh, ["class", "images", "accuracy", "precision", "recall", "f1"])
            w.writeheader()
            w.writerows(
                {k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in self.per_class()
            )
        with written[1].open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["true", "predicted", "images", "share_of_true"])
            w.writerows([t, p, n, round(s, 6)] for t, p, n, s in self.pairs())
        with written[2].open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["image", "true", "predicted", "prob_true"])
            for p, i, t, q in self.worst:
                w.writerow(
                    [
                        self.name_of(i) if self.name_of else f"test image {i}",
                        self.classes[t],
                        self.classes[q],
                        round(p, 6),
                    ]
                )
        self.picture(written[3])
        return written

    def picture(self, path: Path) -> None:
        """Row-normalised confusion matrix; every class name where they fit, else every k-th."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n = len(self.classes)
        rows = self.confusion.double()
        rows = (rows / rows.sum(1, keepdim=True).clamp(min=1)).cpu().numpy()
        side = min(16.0, max(6.0, 0.3 * n + 2))
        fig, ax = plt.subplots(figsize=(side + 1.5, side))
        im = ax.imshow(rows, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
        every = max(1, -(-n // LABELS_FIT))
        ticks = list(range(0, n, every))
        font = min(10.0, 0.7 * side * 72 * 0.8 / len(ticks))  # points: the axis's length shared by its labels
        ax.set_xticks(ticks, [self.classes[i] for i in ticks], rotation=90, fontsize=font)
        ax.set_yticks(ticks, [self.classes[i] for i in ticks], fontsize=font)
        if n <= 15:  # the share in each cell where it can be read
            for i in range(n):
                for j in range(n):
                    if rows[i, j] >= 0.005:
                        ax.text(
                            j,
                            i,
                            f"{100 * rows[i, j]:.0f}",
                            ha="center",
                            va="center",
                            fontsize=8,
                            color="white" if rows[i, j] > 0.5 else "black",
                        )
        ax.set_xlabel("predicted" + (f" (one class name in {every} shown)" if every > 1 else ""))
        ax.set_ylabel("true")
        acc = self.confusion.diag().sum().item() / max(1, self.confusion.sum().item())
        ax.set_title(
            f"confusion matrix, rows normalised: {int(self.confusion.sum())} test images, accuracy {100 * acc:.2f}%"
        )
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def merge(rt, collector: Collector, classes: list[str], name_of: Callable[[int], str] | None) -> Report:
    """Every rank's counts summed, every rank's worst images merged (on every rank)."""
    from trainer.worker.runtime import all_reduce_sum

    confusion = all_reduce_sum(rt, collector.confusion).view(len(classes), len(classes)).cpu()
    worst = collector.worst
    if rt.collectives:
        import torch.distributed as dist

        gathered: list = [None] * rt.world_size
        dist.all_gather_object(gathered, worst)
        worst = sorted(w for part in gathered for w in part)[:WORST]
    return Report(classes, confusion, worst, name_of)
