"""What the user sees: a progress bar or log lines, JSON lines, the curves PNG, and step timing.

Only rank 0 prints and writes. Losses stay on the device between log points: reading one is a
CPU-GPU sync point, so it happens every ``train.log_every`` steps, not every step.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.contract import COMMAND_START_ENV
from trainer.files import replacing
from trainer.worker.runtime import Runtime


def since_command() -> float | None:
    """Seconds since the command started (supervisor.stamp_command_start), as a user feels a start;
    None after torchrun restarted the workers (their command started long before) or without the stamp."""
    stamp = os.environ.get(COMMAND_START_ENV)
    if not stamp or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    try:
        return round(time.time() - float(stamp), 3)
    except ValueError:
        return None


class Startup:
    """Seconds spent in each start-up phase, logged with the first step (metrics.jsonl's
    ``first_step`` event): where a start's, or a restart's, time to its first step went."""

    def __init__(self, started_at: float):
        self.started_at = self.last = started_at
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self.last, 3)
        self.last = now

    @staticmethod
    def compile_seconds(top: int = 16) -> dict[str, float]:
        """torch.compile's own timings (dynamo, AOTAutograd, inductor, cache loads), largest first."""
        try:
            from torch._dynamo.utils import compilation_time_metrics
        except ImportError:  # pragma: no cover - a torch without it
            return {}
        sums = {k: round(sum(v), 3) for k, v in compilation_time_metrics.items() if v}
        return dict(sorted(sums.items(), key=lambda kv: -kv[1])[:top])

    @staticmethod
    def graph_cache_counts() -> dict[str, int]:
        """Compiled graphs found in and missing from the caches so far: inductor's (its generated
        code: a miss means inductor compiled that graph) and AOTAutograd's (which torch bypasses
        for the subgraphs of a DDP graph split at buckets: those are traced again, their inductor
        code still comes from the cache). The timer names in compile_seconds cannot tell these
        apart: fx_codegen_and_compile also times a cache hit behind a bypassed AOTAutograd."""
        from torch._dynamo.utils import counters

        ind, aot = counters["inductor"], counters["aot_autograd"]
        return {
            "inductor_hit": ind["fxgraph_cache_hit"],
            "inductor_miss": ind["fxgraph_cache_miss"],
            "aot_autograd_hit": aot["autograd_cache_hit"],
            "aot_autograd_miss": aot["autograd_cache_miss"],
            "aot_autograd_bypass": aot["autograd_cache_bypass"],
        }


class StepTimer:
    """GPU time of the input pipeline and of whole steps, from CUDA events (no sync until read);
    host clocks on the CPU. Also each step's own part: its batch and its forward pass, which wait
    for no other rank (the backward's gradient all-reduce does: a slow rank makes every rank's
    whole step slow, but only its own part)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.forward_end = None
        """Marked by the step after its forward pass (one event record on CUDA)."""
        self.reset()

    def reset(self) -> None:
        self._pairs: list[tuple] = []  # (data_start, data_end, step_end)
        self._host_data = 0.0
        self._host_step = 0.0
        self._own: list = []  # since the last own_ms(): (data_start, forward_end) pairs, or host seconds

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, data_start, data_end, step_end) -> None:
        forward_end, self.forward_end = self.forward_end, None
        if self.cuda:
            self._pairs.append((data_start, data_end, step_end))
            if forward_end is not None:
                self._own.append((data_start, forward_end))
        else:
            self._host_data += data_end - data_start
            self._host_step += step_end - data_start
            if forward_end is not None:
                self._own.append(forward_end - data_start)

    def own_ms(self) -> float:
        """Mean ms per step of the steps' own part since the last call (after a sync on CUDA: the
        log line's loss read has made it)."""
        own, self._own = self._own, []
        if not own:
            return 0.0
        total = sum(a.elapsed_time(b) for a, b in own) if self.cuda else 1e3 * sum(own)
        return total / len(own)

    def read_ms(self) -> tuple[float, float]:
        """(data ms, step ms) summed over the steps since reset; syncs on CUDA."""
        if self.cuda and self._pairs:
            self._pairs[-1][2].synchronize()
            data = sum(a.elapsed_time(b) for a, b, _ in self._pairs)
            step = sum(a.elapsed_time(c) for a, _, c in self._pairs)
            return data, step
        return self._host_data * 1e3, self._host_step * 1e3


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of time intervals, as sorted disjoint intervals (a device's busy time)."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class StepProfiler:
    """torch.profiler over ``profile.steps`` training steps after ``profile.skip`` (config
    ``profile``). Writes a trace and a table per rank and returns a summary for metrics.jsonl: wall
    and device-busy milliseconds per step (busy < wall means the GPU waited for the host: a
    launch-bound step) and the host's blocking waits on the GPU per step."""

    WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync")

    def __init__(self, steps: int, skip: int, folder: Path, rt: Runtime):
        self.steps, self.start_at, self.folder, self.rt = steps, skip, folder, rt
        self.seen = 0
        self.done = False
        self._prof = None
        self._t0 = 0.0

    def before_step(self) -> None:
        if self.steps and self.seen == self.start_at and self._prof is None and not self.done:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.rt.cuda else [])
            self._sync()  # sync point: the window starts with an idle GPU
            self._prof = profile(activities=activities)
            self._prof.start()
            self._t0 = time.perf_counter()

    def after_step(self) -> dict | None:
        """The summary once the window closes, else None."""
        self.seen += 1
        if self._prof is None or self.seen < self.start_at + self.steps:
            return None
        return self.close()

    def close(self) -> dict | None:
        """End the window now (training may end inside it); the summary, or None if none is open."""
        if self._prof is None:
            return None
        self._sync()  # sync point: every profiled kernel has run
        wall = time.perf_counter() - self._t0
        prof, self._prof, self.done = self._prof, None, True
        prof.stop()
        return self._write(prof, wall, self.seen - self.start_at)

    def _sync(self) -> None:
        if self.rt.cuda:
            torch.cuda.synchronize()

    def _write(self, prof, wall: float, steps: int) -> dict:
        from torch.autograd import DeviceType

        events = prof.events()
        kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        busy = sum(b - a for a, b in merged(kernels))  # us
        waits: dict[str, int] = {}
        for e in events:
            if e.device_type == DeviceType.CPU and e.name in self.WAITS:
                waits[e.name] = waits.get(e.name, 0) + 1
        r = self.rt.rank
        prof.export_chrome_trace(str(self.folder / f"profile-rank{r}.json"))
        averages = prof.key_averages()
        tables = [averages.table(sort_by="self_cpu_time_total", row_limit=25)]
        if self.rt.cuda:
            tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=25))
        (self.folder / f"profile-rank{r}.txt").write_text("\n\n".join(tables))
        n = max(1, steps)
        parts: dict[str, float] = {}  # host time of the step's parts (the loop's record_function labels)
        for a in averages:  # on CUDA a label also has a device-side row, with no host time: keep the larger
            if a.key.startswith("step."):
                parts[a.key] = max(parts.get(a.key, 0.0), round(a.cpu_time_total / 1e3 / n, 3))
        return {
            "event": "profile",
            "rank": r,
            "steps": steps,
            "wall_ms_per_step": round(1e3 * wall / n, 3),
            "device_busy_ms_per_step": round(busy / 1e3 / n, 3) if self.rt.cuda else None,
            "kernels_per_step": round(len(kernels) / n, 1),
            "host_ms_per_step": parts,
            "host_waits_per_step": {k: round(v / n, 2) for k, v in sorted(waits.items())},
        }


def medians_of_the_others(values: list[float]) -> dict[int, float]:
    """Each index's median of every other value, from one sort (not one median per index: a
    thousand ranks would sort a million numbers every log interval). {} for fewer than two."""
    order = sorted(range(len(values)), key=values.__getitem__)
    s, m = [values[i] for i in order], len(values) - 1
    if m < 1:
        return {}

    def without(p: int) -> float:
        at = lambda i: s[i] if i < p else s[i + 1]  # noqa: E731 - the sorted values with position p left out
        return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2

    return {r: without(p) for p, r in enumerate(order)}


class Stragglers:
    """Each rank's own time per step (its batch and forward pass: StepTimer.own_ms), gathered every
    log interval, and the rank that is persistently slower than the others: SLOWER x the median
    of the other ranks for PERSIST intervals in a row (of the others: with two ranks the median of
    all is their mean, and a rank twice as slow as its peer would never pass 1.5x it). A straggler holds every rank
    back (DDP waits for it in every
    gradient all-reduce); naming it points at the node to look at. One wait stays inside the
    figure: with dist.broadcast_buffers (batch norm), each forward starts with rank 0's buffers, so
    a slow rank 0 lengthens the others' forward too (then the line names several ranks, or none)."""

    SLOWER = 1.5
    PERSIST = 3
    PERSIST_S = 10.0
    """And slow for this long: a hiccup of a shared host (1.5 s) spans several short intervals, and
    is no straggler."""
    FLOOR_MS = 5.0
    """And at least this much slower: a few milliseconds of scheduling noise on tiny steps is no straggler."""

    def __init__(self, rt: Runtime, hosts: list[tuple[str, list[str]]]):
        self.rt, self.hosts = rt, hosts
        self.streak: dict[int, int] = {}
        self.since: dict[int, float] = {}  # when each slow rank's streak began (the start of its first slow interval)
        self.last = time.monotonic()

    def gather(self, own_ms: float) -> list[float]:
        """Every rank's figure (one small all-gather: call it at the same step on every rank)."""
        if not self.rt.collectives:
            return [own_ms]
        mine = torch.tensor([own_ms], dtype=torch.float32, device=self.rt.device)
        out = [torch.zeros_like(mine) for _ in range(self.rt.world_size)]
        dist.all_gather(out, mine)
        return [round(float(t.item()), 3) for t in out]

    def judge(self, per_rank: list[float], now: float | None = None) -> tuple[dict, str]:
        """(fields for the log record, '' or the progress line's note naming a straggler)."""
        now = time.monotonic() if now is None else now
        median = statistics.median(per_rank)
        slowest = max(range(len(per_rank)), key=per_rank.__getitem__)
        others = medians_of_the_others(per_rank)
        slow = {
            r
            for r, ref in others.items()
            if ref > 0 and per_rank[r] > self.SLOWER * ref and per_rank[r] - ref > self.FLOOR_MS
        }
        self.streak = {r: self.streak.get(r, 0) + 1 for r in slow}
        self.since = {r: self.since.get(r, self.last) for r in slow}
        self.last = now
        record = {"own_ms_median": round(median, 3), "own_ms_slowest": per_rank[slowest], "slowest_rank": slowest}
        if len(per_rank) <= 64:
            record["own_ms_per_rank"] = per_rank
        named = [
            r for r, n in sorted(self.streak.items()) if n >= self.PERSIST and now - self.since[r] >= self.PERSIST_S
        ]
        if not named:
            return record, ""
        record["stragglers"] = named
        host = lambda r: self.hosts[r][0] if r < len(self.hosts) else "?"  # noqa: E731
        return record, "straggler: " + ", ".join(
            f"rank {r} ({host(r)}) {per_rank[r] / others[r]:.1f}x the others' median "
            f"for {now - self.since[r]:.0f} s ({self.streak[r]} intervals)"
            for r in named
        )


def duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """A one-line bar on a terminal, plain log lines otherwise."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = enabled and sys.stdout.isatty()

    def step(
        self,
        epoch: int,
        epochs: int,
        step: int,
        steps: int,
        loss: float,
        images_per_s: float,
        eta_s: float | None = None,
        stalled_s: float = 0.0,
        note: str = "",
    ) -> None:
        if not self.enabled:
            return
        text = f"epoch {epoch + 1}/{epochs} step {step}/{steps} loss {loss:.4f} {images_per_s:,.0f} img/s"
        if eta_s is not None:
            text += f" eta {duration(eta_s)}"
        if stalled_s >= 1:
            text += f" ({duration(stalled_s)} stalled waiting for data or other ranks, not counted in img/s)"
        if note:
            text += f" | {note}"
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


class Board:
    """TensorBoard scalars beside metrics.jsonl, so that `tensorboard --logdir checkpoints` shows
    every run. Rank 0 only; nothing at all when the tensorboard package is missing. A resumed run
    writes from its resume step on (``purge_step``): what a crashed attempt logged past the
    checkpoint it resumed from is dropped, so each curve is one line."""

    SCALARS = {  # metrics.jsonl event -> {record key: TensorBoard tag}
        "log": {"loss": "train/loss", "images_per_s": "train/images_per_s", "lr": "train/lr"},
        "epoch": {
            "train_loss": "epoch/train_loss",
            "test_loss": "epoch/test_loss",
            "test_acc": "epoch/test_acc",
            "images_per_s": "epoch/images_per_s",
            "step_ms_per_step": "epoch/step_ms",
            "data_ms_per_step": "epoch/data_ms",
        },
    }

    def __init__(self, folder: Path, resume_step: int | None):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the optional extra is not installed
            return
        # purge_step drops the earlier attempts' events from that step on: keep the resume step's own
        self.writer = SummaryWriter(
            log_dir=str(folder / "tensorboard"), purge_step=resume_step + 1 if resume_step else None, flush_secs=30
        )

    def add(self, record: dict) -> None:
        tags = self.SCALARS.get(record.get("event"))
        if self.writer is None or not tags:
            return
        for key, tag in tags.items():
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], global_step=record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class RunLog:
    """metrics.jsonl in the run folder, one record per event, and TensorBoard's copy of its
    scalars (rank 0 only)."""

    def __init__(self, folder: Path, rt: Runtime, tensorboard: bool = False, resume_step: int | None = None):
        self.path = folder / "metrics.jsonl"
        self.enabled = rt.is_main
        self.board = Board(folder, resume_step) if tensorboard and self.enabled else None

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
            if self.board is not None:
                self.board.add(record)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()

    def records(self, kind: str) -> list[dict]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [r for r in rows if r.get("event") == kind]


def plot_curves(log: RunLog, png: Path, title: str = "") -> Path | None:
    """curves.png in the run folder (rank 0), from metrics.jsonl: see :func:`draw_curves`."""
    if not log.enabled:
        return None
    fig = draw_curves(log.records("log"), log.records("epoch"), title)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    with replacing(png) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return png


def _throughput(ax, steps: list[int], rates: list[float]) -> None:
    """The images/s of each log window; a short run's one or two as points (a line of one point
    does not show); none yet said in words, not as empty axes."""
    ax.set(xlabel="step", ylabel="images/s", title="Throughput (each log window)")
    if not steps:
        ax.text(
            0.5,
            0.5,
            "no log window yet\n(one every train.log_every steps)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set(xticks=[], yticks=[])
        return
    ax.plot(steps, rates, lw=1, color="tab:purple", marker="o" if len(steps) < 5 else None)
    ax.set_ylim(bottom=0)


def draw_curves(logs: list[dict], epochs: list[dict], title: str):
    """Three panels: the loss at every log line (and each epoch's mean), the images/s of each log
    window, and the test accuracy per epoch on whole-epoch ticks; ``title`` above. After a resume,
    the last record of a step (or an epoch) wins, so each curve is one line. None without records."""
    by_epoch = {r["epoch"]: r for r in epochs}
    by_step = {r["step"]: r for r in logs}
    if not by_epoch and not by_step:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (loss, speed, acc) = plt.subplots(1, 3, figsize=(14, 4))
    steps = sorted(by_step)
    loss.plot(steps, [by_step[k]["loss"] for k in steps], lw=1, label="log line")
    ends = [
        (r["step"], r["train_loss"])
        for _, r in sorted(by_epoch.items())
        if r.get("train_loss") is not None and "step" in r
    ]
    if ends:
        loss.plot(*zip(*ends, strict=True), "o", color="tab:red", label="epoch mean")
    loss.set(xlabel="step", ylabel="train loss", title="Training loss")
    loss.legend(loc="upper right", fontsize="small")
    _throughput(speed, steps, [by_step[k]["images_per_s"] for k in steps])
    tested = [(e, 100 * r["test_acc"]) for e, r in sorted(by_epoch.items()) if r.get("test_acc") is not None]
    if tested:
        acc.plot([e for e, _ in tested], [a for _, a in tested], marker="o", color="tab:green")  # epochs count from 1
        for e, a in tested[-1:]:
            acc.annotate(f"{a:.2f}%", (e, a), textcoords="offset points", xytext=(0, 6), ha="center")
    acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="Test accuracy")
    acc.margins(y=0.15)  # room for the last figure's label
    low, high = acc.get_ylim()
    acc.set_ylim(max(0.0, low), min(100.0, high))  # an accuracy axis ends at 100 %
    acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (loss, speed, acc):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
