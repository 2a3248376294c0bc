"""The one owner a run talks to: it claims the run folder, picks the checkpoint to resume from,
restores it into the registered parts, and saves them.

A save is synchronous, or asynchronous: DCP's BlockingAsyncStager copies the tensors into host
buffers made once and pinned (the only stall), and one thread of ours runs ``dcp.save`` and then
the commit. Not ``dcp.async_save``: its future completes before a done-callback has run, and the
commit (checksums, meta.json, the rename) must be over before the next save or the end goes on.
Not DCP's DefaultStager: on an H100 with torch 2.11 it failed at the first save (KeyError: <class
'type'>, deep-copying a CUDA tensor's attributes), where it worked on the CPU.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch

from trainer.config import Config
from trainer.config_loader import to_dict
from trainer.contract import warn
from trainer.worker.checkpoint import folder as files
from trainer.worker.checkpoint import store
from trainer.worker.checkpoint.lock import FolderLock
from trainer.worker.checkpoint.parts import Stateful, state_bytes


class CheckpointLost(RuntimeError):
    """The picked checkpoint failed its checksums after the model was built for it, and no older
    one is intact: a crash (the launcher's next attempt starts from scratch), not bad input."""


class Checkpointer:
    """Rank 0 writes, and under fsdp every rank writes its shard; every rank calls :meth:`save`.

    A resume: ``claim_and_pick`` (rank 0) before anything is built, then ``confirm`` (rank 0) and,
    once every part exists and is registered, one ``restore``."""

    def __init__(self, cfg: Config, is_main: bool, async_save: bool, sharded: bool = False, say=print):
        self.cfg, self.is_main, self.say = cfg, is_main, say
        self.root = cfg.checkpoint.root
        self.parts: dict[str, Stateful] = {}
        self.async_save, self.sharded = async_save, sharded
        self.writes = is_main or sharded
        self.lock = FolderLock(self.root)
        self.classes: list[str] | None = None
        """The data's class names (saved; a resume on other classes is refused)."""
        self.normalize: dict | None = None
        """The mean and std the images are normalised by (saved: eval, predict and export use the same)."""
        self.group = None
        if sharded:  # a save's plan goes round on gloo: from the write thread, beside training's NCCL
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.dist.timeout_s))
        self._stager = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._sums: Future | None = None

    # -- claiming the folder, picking the checkpoint (rank 0)
    # -------------------------------------------------------------------
    def claim_and_pick(self) -> Path | None:
        """Rank 0, before anything is written: the folder is writable and has room, this process
        holds it alone, leftovers are cleaned; returns the checkpoint to resume from (or None)."""
        files.probe(self.root, state_bytes(self.cfg), self.cfg.checkpoint.keep)
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        self.lock.acquire(wait_s=30.0 if restarted else 0.0, say=self.say)
        resume = self.cfg.checkpoint.resume
        path = files.explicit_resume(self.root, resume)
        files.clean_temporaries(self.root)
        if resume != "auto":
            return path  # restore verifies it
        picked = files.newest_good(self.root, say=self.say, sums=False)
        if picked is not None:
            self._hash_behind(picked)
        return picked

    def _hash_behind(self, folder: Path) -> None:
        """The picked checkpoint's checksums, hashed on a thread while the model is built: its
        bytes are read from the volume once, and the restore then finds them in the page cache.
        On the critical path they cost seed.yaml's 2.4 GB 2-4 s of a fresh node's restart. A daemon
        thread, not an executor's: a run that fails before its restore does not wait for the hash."""
        sums: Future = Future()

        def run() -> None:
            try:
                files.check_sums(folder, files.read_meta(folder))
                sums.set_result(None)
            except BaseException as e:  # noqa: BLE001 - given to confirm()
                sums.set_exception(e)

        threading.Thread(target=run, name="checkpoint-sums", daemon=True).start()
        self._sums = sums

    def confirm(self, path: Path | None) -> Path | None:
        """Rank 0, before the restore: ``path`` if its checksums (hashed since the pick) match; a
        damaged one is set aside, with a line, for the newest intact one before it."""
        if self._sums is None:  # nothing picked, or an explicit path (restore verifies it)
            return path
        error, self._sums = self._sums.exception(), None
        if error is None:
            return path
        if not isinstance(error, files.CheckpointError):
            raise error
        files.set_aside(self.root, path, error, say=self.say)
        older = files.newest_good(self.root, say=self.say)
        if older is None:  # the model was built for a resume (its normalisation, no pretrained weights)
            raise CheckpointLost(
                f"{path.name} was damaged and no older checkpoint in {self.root} is intact: this attempt stops; "
                f"the next start of the same command starts from scratch"
            )
        return older

    # -- restoring ----------------------------------------------------------------------------
    def restore(self, path: Path) -> None:
        """Load the checkpoint at ``path`` into every registered part, in registration order (the
        model first). Rank 0 verified it when it picked it under resume=auto; an explicit path is
        verified here. A part the checkpoint lacks (Lookahead switched on later, bf16 weights after
        an fp32 run) starts from the restored weights."""
        path, about, old = store.open_checkpoint(path, verify=self.is_main and self.cfg.checkpoint.resume != "auto")
        files.check_model(about.get("model"), self.cfg.model.name, path)
        files.check_global_batch(about.get("batch_size"), self.cfg.train.batch_size, path)
        files.check_classes(about.get("classes"), self.classes, path)
        for part in self.parts.values():  # a format-1 checkpoint holds whole tensors
            if hasattr(part, "full"):
                part.full = old is not None
        saved = store.load_into(path, {k: p.state_dict() for k, p in self.parts.items()}, about, self.group, old)
        for key, part in self.parts.items():
            if key == "model":
                part.load_state_dict(saved["model"], path)  # type: ignore[call-arg]
            elif key in saved:
                part.load_state_dict(saved[key])
            elif hasattr(part, "from_model"):
                self.say(f"{path} has no {key} state; it starts from the checkpoint's weights")
                part.from_model()
        for part in self.parts.values():
            if hasattr(part, "full"):
                part.full = False

    # -- saving -------------------------------------------------------------------------------
    def register(self, **parts: Stateful | None) -> None:
        self.parts.update({k: v for k, v in parts.items() if v is not None})

    def _state(self) -> tuple[dict, dict]:
        tensors, rest = store.split({k: p.state_dict() for k, p in self.parts.items()})
        about = {
            "model": self.cfg.model.name,
            "classes": self.classes,
            "normalize": self.normalize,
            "batch_size": self.cfg.train.batch_size,
            "epoch": rest.get("train", {}).get("epoch"),
            "config": to_dict(self.cfg),
            "state": rest,
        }
        return tensors, about

    def _stage(self, tensors: dict) -> dict:
        if self._stager is None:
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            # host buffers made once and reused from save to save, pinned on a GPU host
            self._stager = BlockingAsyncStager(cache_staged_state_dict=torch.cuda.is_available())
        return self._stager.stage(tensors)

    def reserve(self) -> None:
        """Host buffers for async saves, once the optimizer state exists (after the first step):
        pinning gigabytes takes a second or more, which no save should pay."""
        if self.async_save and self.writes:
            self._stage(self._state()[0])

    def save(self, step: int, sync: bool) -> tuple[float, bool] | None:
        """Write ``step-N`` from the registered parts; (stall seconds, async) on rank 0, else None.
        Only the copy to host memory stalls training when async."""
        if not self.writes:
            return None
        tensors, about = self._state()
        t0 = time.perf_counter()
        self.wait()
        keep = self.cfg.checkpoint.keep
        background = self.async_save and not sync
        if background:
            staged = self._stage(tensors)

            def run():
                try:
                    store.write(
                        staged, self.root, step, keep, about, writer=self.is_main, group=self.group, say=self.say
                    )
                except BaseException as e:  # noqa: BLE001 - re-raised in wait()
                    self._error = e

            self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=False)
            self._thread.start()
        else:
            store.write(tensors, self.root, step, keep, about, writer=self.is_main, group=self.group, say=self.say)
        return (time.perf_counter() - t0, background) if self.is_main else None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            warn(f"background checkpoint write failed: {err}")
            raise err

    def close(self) -> None:
        self.lock.release()
        if self._stager is not None:
            self._stager.close()
