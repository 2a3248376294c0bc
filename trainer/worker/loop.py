"""The training loop: ``Trainer.fit()`` over ``train_epoch()``, ``train_step()``, ``evaluate()`` and
``save()``. Everything around it (config, process group, data, checkpoints) is built by
trainer/worker/run.py and handed in as a :class:`Run`."""

from __future__ import annotations

import time

import torch
from torch.profiler import record_function

from trainer.config_loader import to_yaml
from trainer.contract import EXIT_PREEMPTED, stopped_by_torchrun
from trainer.worker import compile_cache, parallel
from trainer.worker.evaluate import evaluate
from trainer.worker.faults import step_hooks
from trainer.worker.metrics import StepProfiler, StepTimer, Stragglers, plot_curves, since_command
from trainer.worker.run import Run
from trainer.worker.runtime import all_reduce_sum, barrier


class LogWindow:
    """Loss and steps since the last log line; the loss is summed on the device (no sync a step)."""

    def __init__(self, device: torch.device, stalled_s: float = 0.0):
        self.loss = torch.zeros((), device=device)
        self.steps = 0
        self.start = time.perf_counter()
        self.stalled_s = stalled_s
        """The watchdog's stall count at the window's start: stalls are left out of images/s and the ETA."""

    def add(self, loss: torch.Tensor) -> None:
        self.loss += loss
        self.steps += 1

    def due(self, step: int, every: int, seconds: float) -> bool:
        # a host clock read, no sync
        return step % every == 0 or bool(seconds and time.perf_counter() - self.start >= seconds)

    def reset(self, now: float, stalled_s: float) -> None:
        self.loss.zero_()
        self.steps, self.start, self.stalled_s = 0, now, stalled_s


class Trainer:
    def __init__(self, run: Run):
        self.run = run
        self.cfg, self.rt, self.state = run.cfg, run.rt, run.state
        self.timer = StepTimer(self.rt.cuda)
        self.stragglers = Stragglers(self.rt, run.hosts)
        self.profiler = StepProfiler(self.cfg.profile.steps, self.cfg.profile.skip, run.root, self.rt)
        self.last_saved = self.state.step if run.resumed_from else -1
        self.first_step_s: float | None = None
        self.reserved = False
        self.hooks = step_hooks(self.rt.rank)  # the tests' (TRAINER_FAULT, TRAINER_SAMPLE_TRACE); None in a user's run

    def fit(self) -> int:
        """Train to the end (exit code 0), or until a signal (a checkpoint, then EXIT_PREEMPTED)."""
        self.start()
        while self.state.epoch < self.cfg.train.epochs and not self.done_steps():
            if self.train_epoch(self.state.epoch):
                self.save(sync=True)
                if stopped_by_torchrun():  # not a preemption: the group goes on at its new size
                    self.run.say.line(
                        f"stopped by torchrun for a re-form of the group at step {self.state.step}; checkpoint saved, "
                        "the re-formed group resumes from it"
                    )
                else:
                    self.run.say.line(
                        f"stopped by {self.run.stop.signal_name} at step {self.state.step}; checkpoint saved, exit "
                        f"{EXIT_PREEMPTED}"
                    )
                return EXIT_PREEMPTED
            self.end_epoch()
        self.finish()
        return 0

    # ----------------------------------------------------------------------------------------
    def start(self) -> None:
        run = self.run
        if self.rt.is_main:
            (run.root / "config.yaml").write_text(to_yaml(self.cfg))
        shown = torch.cuda.device_count() if self.rt.strategy == "dp" else self.rt.world_size
        where = (
            f"resuming from {run.resumed_from} (epoch {self.state.epoch}, step {self.state.step})"
            if run.resumed_from
            else "starting fresh"
        )
        run.say.line(
            f"{self.cfg.model.name} | strategy {self.rt.strategy} x{shown} on {self.rt.device.type} | "
            f"{run.data_plan.describe(len(run.train_split), len(run.test_split), len(run.train_split.classes))} | "
            f"{run.fast} | " + (f"{run.weights} | " if run.weights else "") + f"{where} | run folder {run.root}"
        )
        run.metrics.write(
            {
                "event": "start",
                "strategy": self.rt.strategy,
                "world_size": self.rt.world_size,
                "step": self.state.step,
                "resumed_from": str(run.resumed_from) if run.resumed_from else None,
                "fast": str(run.fast),
            }
        )
        if run.fast.compile or self.rt.cuda:
            self.warm_up()

    def warm_up(self) -> None:
        """Compile, and let cuDNN time its kernels for the training shapes (cudnn.benchmark; 1.7 s
        in ResNet-18's first eager epoch otherwise), before the clock starts: forward and backward
        on a real batch (three times when the compile mode uses CUDA graphs, as reduce-overhead and
        max-autotune do: cudagraph trees run once, then record, then replay), then the weights,
        buffers (batch-norm statistics) and gradients are put back as they were. One augmentation
        too: the first launch of each CUDA kernel loads its module (lazy loading, tens of
        milliseconds in all), which the first epoch's input pipeline would otherwise pay. It draws
        the epoch-0 numbers that training then uses: no random state moves."""
        run = self.run
        clock = run.startup
        clock.mark("build_rest")  # input pipeline, run log, watchdog
        saved = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
        x, y = run.loader.first_batch()
        run.net.train()
        for i in range(3 if run.fast.cudagraphs else 1):
            _ = self.forward_backward(x, y).item()
            # the model's: with bf16 weights the optimizer holds only their masters
            run.model.zero_grad(set_to_none=True)
            clock.mark("compile_and_first_forward_backward" if i == 0 else "cuda_graph_recording")
        if run.extras.warm_up(run.optimizer):
            clock.mark("master_update_compile")
        with torch.no_grad():
            for k, v in run.model.state_dict().items():
                v.copy_(saved[k])
        clock.mark("restore_after_warm_up")
        # both clocks at the same moment
        self.first_step_s, since = time.perf_counter() - run.started_at, since_command()
        self.record_first_step(since)

    def record_first_step(self, since: float | None) -> None:
        """Seal the compile cache for the next start, say what it held, and record the first step's figures."""
        run, clock = self.run, self.run.startup
        cache_bytes = 0
        if run.compile_cache != "off" and self.rt.is_main:
            # what this start compiled or found, for the next one
            cache_bytes = compile_cache.seal(run.root, run.compile_key)
            clock.mark("compile_cache_seal (after the first-step clock)")
        if run.compile_cache != "off":
            run.say.line(
                f"compile cache {run.compile_key}: {run.compile_cache}"
                + (f"; sealed {cache_bytes / 2**20:.1f} MiB for restarts" if cache_bytes else "")
            )
        run.metrics.write(
            {
                "event": "first_step",
                "seconds": round(self.first_step_s, 3),
                "since_command_s": since,
                "compiled": run.fast.compile,
                "compile_cache": run.compile_cache,
                "compile_cache_bytes": cache_bytes,
                "startup_s": clock.phases,
                "compile_s": clock.compile_seconds() if run.fast.compile else {},
                "graph_cache": clock.graph_cache_counts() if run.fast.compile else {},
            }
        )

    def done_steps(self) -> bool:
        return 0 < self.cfg.train.max_steps <= self.state.step

    # The record_function labels name the parts of a step in profiles (profile.steps); without a
    # profiler running each costs about a microsecond.
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with (
            record_function("step.forward"),
            torch.autocast(self.rt.device.type, dtype=torch.bfloat16, enabled=self.run.fast.bf16),
        ):
            loss = self.run.net(x, y)  # the model and its loss (compiled together)
        self.timer.forward_end = self.timer.mark()  # the step's own part ends: the backward waits for the other ranks
        with record_function("step.backward"):
            loss.backward()
        return loss.detach()

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        run = self.run
        loss = self.forward_backward(x, y)
        with record_function("step.optimizer"):
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.schedule.step()
            run.extras.after_step(self.state.step + 1, run.total_steps)
        return loss

    def train_epoch(self, epoch: int) -> bool:
        """One epoch from ``state.epoch_step``; True when every rank agreed to stop on a signal."""
        run, cfg, st = self.run, self.cfg, self.state
        run.net.train()
        self.timer.reset()
        loss_sum, window = torch.zeros((), device=self.rt.device), LogWindow(self.rt.device, run.watchdog.stalled_s)
        steps = 0
        self.resumed_at = st.epoch_step  # > 0: this epoch's figures cover only the steps after a resume
        t_epoch = time.perf_counter()
        batches = run.loader.epoch(epoch, st.epoch_step)
        while True:
            batch, d0, d1 = self.read_batch(batches, st.step + 1)
            if batch is None:
                break
            if self.hooks:
                self.hooks.after_read(epoch, st.epoch_step, batch[2])
            run.watchdog.at("step")
            loss = self.train_step(batch[0], batch[1])
            self.timer.add(d0, d1, self.timer.mark())
            st.step += 1
            st.epoch_step += 1
            run.watchdog.beat(st.step)  # progress, for the hang watchdog: a clock read, no sync
            steps += 1
            loss_sum += loss
            window.add(loss)
            self.after_step(epoch, window, loss)
            with record_function("step.stop_poll"):
                stop = run.stop.poll()  # every rank agrees (a tiny all-reduce under ddp)
            if stop:
                return True
            if cfg.checkpoint.every_steps and st.step % cfg.checkpoint.every_steps == 0:
                self.save()
            if self.done_steps():
                break
        self.epoch_stats = self.summarize(steps, loss_sum, t_epoch)
        return False

    def read_batch(self, batches, step: int) -> tuple:
        """The next batch (None at the epoch's end), augmented on the device (by the epoch, or by the
        step from host memory), and the timer's marks around its read, which the watchdog names if it hangs."""
        self.profiler.before_step()
        d0 = self.timer.mark()
        self.run.watchdog.at("data")
        with record_function("step.data"):
            if self.hooks:
                self.hooks.before_read(step)  # tests: a read that blocks, a kill
            batch = next(batches, None)
        return batch, d0, self.timer.mark()

    def after_step(self, epoch: int, window: LogWindow, loss: torch.Tensor) -> None:
        """The profiler's step, the first step's record, and the progress line when one is due."""
        self.profiled(self.profiler.after_step())
        self.after_first_step(loss)
        if window.due(self.state.step, self.cfg.train.log_every, self.cfg.train.log_seconds):
            self.log(epoch, window)

    def after_first_step(self, loss: torch.Tensor) -> None:
        """Once: host buffers for async saves, and the first-step record (when no warm-up wrote it)."""
        if not self.reserved:
            self.reserve()
        if self.first_step_s is None:
            _ = loss.item()  # one-time sync: time to first step includes compilation
            self.first_step_s = time.perf_counter() - self.run.started_at
            self.run.metrics.write(
                {"event": "first_step", "seconds": round(self.first_step_s, 3), "since_command_s": since_command()}
            )

    def log(self, epoch: int, window: LogWindow) -> None:
        run, cfg, step = self.run, self.cfg, self.state.step
        value = (window.loss / window.steps).item()  # CPU-GPU sync point, once per log line
        now, stalled = time.perf_counter(), run.watchdog.stalled_s
        stall = stalled - window.stalled_s  # a link cut ridden out, a slow read: not the run's pace
        busy = max(now - window.start - stall, 1e-9)
        ips = window.steps * cfg.train.batch_size / busy
        eta = (run.total_steps - step) * busy / window.steps
        ranks, note = {}, ""
        if step % cfg.train.log_every == 0:  # the same steps on every rank (a time-based line is not): an all-gather
            ranks, note = self.stragglers.judge(self.stragglers.gather(self.timer.own_ms()))
        run.say.step(epoch, cfg.train.epochs, self.state.epoch_step, run.steps_per_epoch, value, ips, eta, stall, note)
        run.metrics.write(
            {
                "event": "log",
                "epoch": epoch,
                "step": step,
                "loss": round(value, 5),
                "images_per_s": round(ips, 1),
                "window_steps": window.steps,
                "stalled_s": round(stall, 3),
                "lr": run.schedule.get_last_lr()[0],
                **ranks,
            }
        )
        window.reset(now, stalled)

    def summarize(self, steps: int, loss_sum: torch.Tensor, t_epoch: float) -> dict:
        """The epoch's figures: mean loss over every rank, time, throughput, data and step time."""
        if self.rt.cuda:
            torch.cuda.synchronize()  # once per epoch, for an honest epoch time
        seconds = time.perf_counter() - t_epoch
        data_ms, step_ms = self.timer.read_ms()
        mean_loss = all_reduce_sum(self.rt, torch.stack([loss_sum, torch.tensor(float(steps), device=self.rt.device)]))
        return {
            # None: every step ran before a resume
            "train_loss": round((mean_loss[0] / mean_loss[1]).item(), 5) if steps else None,
            "train_seconds": round(seconds, 3),
            "steps": steps,
            "images_per_s": round(steps * self.cfg.train.batch_size / seconds, 1) if steps else None,
            "data_ms_per_step": round(data_ms / steps, 4) if steps else None,
            "step_ms_per_step": round(step_ms / steps, 4) if steps else None,
        }

    def end_epoch(self) -> None:
        cfg, st, epoch = self.cfg, self.state, self.state.epoch
        last = epoch + 1 == cfg.train.epochs or self.done_steps()
        test_loss = test_acc = None
        if last or (epoch + 1) % cfg.train.eval_every == 0:
            self.run.watchdog.at("eval")
            parallel.sync_buffers(self.run.model, self.rt)
            test_loss, test_acc = evaluate(
                self.run.model,
                self.run.test_split,
                self.cfg,
                self.rt,
                self.run.augment,
                self.run.fast.bf16,
                self.run.watchdog.beat,
            )
        if not self.done_steps() or st.epoch_step >= self.run.steps_per_epoch:
            st.epoch, st.epoch_step = epoch + 1, 0
        partial = {"resumed_at_epoch_step": self.resumed_at} if self.resumed_at else {}
        record = {
            "event": "epoch",
            "epoch": epoch + 1,
            "step": st.step,
            **self.epoch_stats,
            **partial,
            "test_loss": None if test_loss is None else round(test_loss, 5),
            "test_acc": None if test_acc is None else round(test_acc, 5),
        }
        self.run.metrics.write(record)
        acc = "" if test_acc is None else f" | test acc {100 * test_acc:.2f}%"
        self.run.say.line(f"epoch {epoch + 1}/{cfg.train.epochs} | {self._train_figures(acc)}")
        every = cfg.checkpoint.every_epochs
        if not last and every and (epoch + 1) % every == 0:
            self.save()

    def _train_figures(self, acc: str) -> str:
        stats = self.epoch_stats
        if not stats["steps"]:  # resumed from a checkpoint of the epoch's last step: only its evaluation was left
            return f"train steps all done before the resume{acc}"
        part = (
            f" (steps {self.resumed_at + 1}-{self.resumed_at + stats['steps']}, after a resume)"
            if self.resumed_at
            else ""
        )
        speed = f"{stats['images_per_s']:,.0f} img/s | {stats['train_seconds']:.1f}s"
        return f"train loss {stats['train_loss']:.4f}{part}{acc} | {speed}"

    def reserve(self) -> None:
        """Pinned host buffers for async saves, once the optimizer state exists (after a step):
        pinning gigabytes takes a second or more, which no save should pay."""
        self.run.checkpointer.reserve()
        self.reserved = True

    def save(self, sync: bool = False) -> None:
        """Rank 0 writes step-N; with async saves only the copy to pinned memory stalls training."""
        run, st = self.run, self.state
        if self.last_saved == st.step:
            return
        run.watchdog.at("save")
        done = run.checkpointer.save(st.step, sync)
        if done is not None:
            run.metrics.write({"event": "checkpoint", "step": st.step, "stall_s": round(done[0], 4), "async": done[1]})
        if sync or not run.fast.async_save:  # decided alike on every rank (only rank 0 writes)
            barrier(self.rt)  # the others wait until the checkpoint is on disk
        self.last_saved = st.step
        run.watchdog.beat(kind="save")

    def profiled(self, summary: dict | None) -> None:
        if summary is not None:
            self.run.metrics.write(summary)
            self.run.say.line(
                f"profiled {summary['steps']} steps: {self.run.root}/profile-rank{self.rt.rank}.json and .txt"
            )

    def finish(self) -> None:
        self.profiled(self.profiler.close())
        self.save(sync=True)
        self.run.checkpointer.wait()
        barrier(self.rt)
        procs = f"{self.rt.world_size} process{'es' if self.rt.world_size > 1 else ''}"
        on = f"{self.rt.strategy}, {procs} on {self.rt.device.type}, batch {self.cfg.train.batch_size}"
        title = f"{self.cfg.model.name} on {self.run.data_plan.source}: {on}"
        if self.cfg.train.plot and plot_curves(self.run.metrics, self.run.root / "curves.png", title):
            self.run.say.line(f"wrote {self.run.root / 'curves.png'}")
        self.run.say.line(f"done: step {self.state.step}, checkpoints in {self.run.root}")
