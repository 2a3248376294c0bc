"""What the user sees: a progress bar or log lines, JSON lines, the curves PNG, and step timing.

Only rank 0 prints and writes. Losses stay on the device between log points: reading one is a
CPU-GPU sync point, so it happens every ``train.log_every`` steps, not every step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from trainer.dist import Runtime


class StepTimer:
    """Device time of the input pipeline and of whole steps, from CUDA events (no sync until read);
    host clocks on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.reset()

    def reset(self) -> None:
        self._pairs: list[tuple] = []  # (data_start, data_end, step_end)
        self._host_data = 0.0
        self._host_step = 0.0

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, data_start, data_end, step_end) -> None:
        if self.cuda:
            self._pairs.append((data_start, data_end, step_end))
        else:
            self._host_data += data_end - data_start
            self._host_step += step_end - data_start

    def read_ms(self) -> tuple[float, float]:
        """(data ms, step ms) summed over the steps since reset; syncs on CUDA."""
        if self.cuda and self._pairs:
            self._pairs[-1][2].synchronize()
            data = sum(a.elapsed_time(b) for a, b, _ in self._pairs)
            step = sum(a.elapsed_time(c) for a, _, c in self._pairs)
            return data, step
        return self._host_data * 1e3, self._host_step * 1e3


class Progress:
    """A one-line bar on a terminal, plain log lines otherwise."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = enabled and sys.stdout.isatty()

    def step(self, epoch: int, epochs: int, step: int, steps: int, loss: float, images_per_s: float) -> None:
        if not self.enabled:
            return
        text = f"epoch {epoch + 1}/{epochs} step {step}/{steps} loss {loss:.4f} {images_per_s:,.0f} img/s"
        if self.tty:
            done = int(30 * step / max(1, steps))
            print(f"\r[{'#' * done}{'.' * (30 - done)}] {text}", end="", flush=True)
        else:
            print(text, flush=True)

    def line(self, text: str) -> None:
        if self.enabled:
            if self.tty:
                print("\r\033[K", end="")
            print(text, flush=True)


class RunLog:
    """metrics.jsonl in the run folder, one record per event (rank 0 only)."""

    def __init__(self, folder: Path, rt: Runtime):
        self.path = folder / "metrics.jsonl"
        self.enabled = rt.is_main

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def records(self, kind: str) -> list[dict]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [r for r in rows if r.get("event") == kind]


def plot_curves(log: RunLog, png: Path) -> Path | None:
    """Train loss and test accuracy per epoch (the last record of each epoch wins after a resume)."""
    if not log.enabled:
        return None
    by_epoch = {r["epoch"]: r for r in log.records("epoch")}
    if not by_epoch:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = sorted(by_epoch)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(epochs, [by_epoch[e]["train_loss"] for e in epochs], marker="o")
    ax1.set(xlabel="epoch", ylabel="train loss", title="Training loss")
    acc = [(e, by_epoch[e]["test_acc"]) for e in epochs if by_epoch[e].get("test_acc") is not None]
    if acc:
        ax2.plot([a for a, _ in acc], [100 * b for _, b in acc], marker="o", color="tab:green")
    ax2.set(xlabel="epoch", ylabel="test accuracy (%)", title="Test accuracy")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(png)
    return png
