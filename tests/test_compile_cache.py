"""Compiled artifacts on the checkpoint volume (trainer/compile_cache.py): the key, damage, pruning,
and a real compiled run that saves them and a restart on a "fresh node" that loads them."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import env, run

from trainer import compile_cache
from trainer.config import Config
from trainer.dist import Runtime
from trainer.setup import Fast


def runtime(world_size: int = 1, strategy: str = "cpu") -> Runtime:
    return Runtime(strategy=strategy, backend="gloo", device=torch.device("cpu"), rank=0, world_size=world_size, local_rank=0, local_world_size=world_size)


def fast(**kw) -> Fast:
    return Fast(**{"bf16": False, "channels_last": False, "compile": True, "device_resident": True, "async_save": False, **kw})


def test_the_key_changes_with_what_is_compiled_and_nothing_else(monkeypatch):
    cfg = Config()
    base = compile_cache.key(cfg, runtime(), fast())
    assert base == compile_cache.key(Config(), runtime(), fast()) and len(base) == 16

    def changed(mutate) -> str:
        c = Config()
        mutate(c)
        return compile_cache.key(c, runtime(), fast())

    # what changes the compiled graphs: another key each
    others = {changed(lambda c: setattr(c.model, "name", "tinynet")), changed(lambda c: setattr(c.model, "compile_mode", "max-autotune")),
              changed(lambda c: setattr(c.train, "batch_size", 256)), changed(lambda c: setattr(c.dist, "bucket_mb", 50)),
              compile_cache.key(cfg, runtime(world_size=2, strategy="ddp"), fast()), compile_cache.key(cfg, runtime(), fast(bf16=True))}
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    others.add(compile_cache.key(cfg, runtime(), fast()))
    monkeypatch.undo()
    assert base not in others and len(others) == 7
    # what does not: where the run writes, how long it trains, how it logs
    for mutate in (lambda c: setattr(c.checkpoint, "dir", "/elsewhere"), lambda c: setattr(c.train, "epochs", 99),
                   lambda c: setattr(c.train, "log_every", 3), lambda c: setattr(c.data, "dir", "/data")):
        assert changed(mutate) == base


def test_a_missing_blob_is_none_and_a_damaged_one_is_ignored_with_a_warning(tmp_path):
    assert compile_cache.load(tmp_path, "k") == "none"
    blob, digest = compile_cache.paths(tmp_path, "k")
    blob.parent.mkdir()
    blob.write_bytes(b"not what torch saved")
    digest.write_text("0" * 64)
    with pytest.warns(UserWarning, match=r"ignoring the damaged compile cache .*k\.bin \(ValueError: checksum mismatch\)"):
        assert compile_cache.load(tmp_path, "k") == "damaged"
    digest.write_text(hashlib.sha256(blob.read_bytes()).hexdigest())  # the right checksum, garbage inside
    with pytest.warns(UserWarning, match="ignoring the damaged compile cache"):
        assert compile_cache.load(tmp_path, "k") == "damaged"


def test_save_writes_blob_and_checksum_and_keeps_the_newest(tmp_path, monkeypatch):
    folder = tmp_path / compile_cache.FOLDER
    folder.mkdir()
    for i in range(compile_cache.KEEP + 1):  # older blobs, oldest first
        for path in compile_cache.paths(tmp_path, f"old{i}"):
            path.write_bytes(b"x")
            os.utime(path, (time.time() - 100 + i, time.time() - 100 + i))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    assert compile_cache.save(tmp_path, "new") == len(b"artifacts")
    kept = sorted(p.stem for p in folder.glob("*.bin"))
    assert kept == sorted(["new", *(f"old{i}" for i in range(2, compile_cache.KEEP + 1))])
    assert sorted(p.stem for p in folder.glob("*.sha256")) == kept and not list(folder.glob("*.tmp"))
    blob, digest = compile_cache.paths(tmp_path, "new")
    assert blob.read_bytes() == b"artifacts" and digest.read_text() == hashlib.sha256(b"artifacts").hexdigest()


def first_step(ckpt: Path) -> dict:
    return [e for e in map(json.loads, (ckpt / "metrics.jsonl").read_text().splitlines()) if e.get("event") == "first_step"][-1]


@pytest.mark.slow
def test_a_restart_on_a_fresh_node_loads_the_compiled_step_and_a_damaged_cache_is_rebuilt(tmp_path):
    ckpt = tmp_path / "ck"

    def train(steps: int, node: str):
        # each "node" starts with empty local inductor and Triton caches: only the volume is shared
        cmd = [sys.executable, "-m", "trainer", "train", "--config", "configs/smoke.yaml", "model.compile=true", "model.compile_cache=true", f"checkpoint.dir={ckpt}",
               f"train.max_steps={steps}", "train.plot=false", "train.tensorboard=false"]
        return run(cmd, env=env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / node / "inductor"), TRITON_CACHE_DIR=str(tmp_path / node / "triton")),
                   timeout=600)

    p = train(2, "node-a")
    cold = first_step(ckpt)
    assert p.returncode == 0 and cold["compile_cache"] == "none" and cold["compile_cache_saved_bytes"] > 0, p.stdout[-2000:]
    (blob,) = (ckpt / compile_cache.FOLDER).glob("*.bin")
    assert blob.stat().st_size == cold["compile_cache_saved_bytes"]

    p = train(4, "node-b")
    warm = first_step(ckpt)
    assert p.returncode == 0 and warm["compile_cache"].startswith("loaded ") and int(warm["compile_cache"].split()[1]) > 0, p.stdout[-2000:]
    assert warm["compile_cache_saved_bytes"] == 0 and f"compile cache {blob.stem}: loaded" in p.stdout

    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])  # a torn copy on the volume
    p = train(6, "node-c")
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "ignoring the damaged compile cache" in out, out[-2000:]
    assert first_step(ckpt)["compile_cache"] == "damaged" and first_step(ckpt)["compile_cache_saved_bytes"] > 0
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.with_suffix(".sha256").read_text()  # rebuilt whole


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_run(tmp_path, monkeypatch):
    (tmp_path / compile_cache.FOLDER).write_text("a file where the folder should be")
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    with pytest.warns(UserWarning, match="could not save the compile cache .*the next start compiles again"):
        assert compile_cache.save(tmp_path, "k") == 0
