"""Compiled artifacts on the checkpoint volume (trainer/worker/compile_cache.py): the key, damage, pruning,
and a real compiled run that saves them and a restart on a "fresh node" that loads them."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import env, run

from trainer.config import Config
from trainer.worker import compile_cache
from trainer.worker.run import Fast
from trainer.worker.runtime import Runtime


def runtime(world_size: int = 1, strategy: str = "cpu") -> Runtime:
    return Runtime(
        strategy=strategy, backend="gloo", device=torch.device("cpu"), rank=0, world_size=world_size, local_rank=0
    )


def fast(**kw) -> Fast:
    return Fast(
        **{"bf16": False, "channels_last": False, "compile": True, "device_resident": True, "async_save": False, **kw}
    )


def test_the_key_changes_with_what_is_compiled_and_nothing_else(monkeypatch):
    cfg = Config()
    base = compile_cache.key(cfg, runtime(), fast())
    assert base == compile_cache.key(Config(), runtime(), fast()) and len(base) == 16

    def changed(mutate) -> str:
        c = Config()
        mutate(c)
        return compile_cache.key(c, runtime(), fast())

    # what changes the compiled graphs: another key each
    others = {
        changed(lambda c: setattr(c.model, "name", "tinynet")),
        changed(lambda c: setattr(c.model, "compile_mode", "max-autotune")),
        changed(lambda c: setattr(c.train, "batch_size", 256)),
        changed(lambda c: setattr(c.dist, "bucket_mb", 50)),
        compile_cache.key(cfg, runtime(world_size=2, strategy="ddp"), fast()),
        compile_cache.key(cfg, runtime(), fast(bf16=True)),
    }
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    others.add(compile_cache.key(cfg, runtime(), fast()))
    monkeypatch.undo()
    assert base not in others and len(others) == 7
    # what does not: where the run writes, how long it trains, how it logs
    for mutate in (
        lambda c: setattr(c.checkpoint, "dir", "/elsewhere"),
        lambda c: setattr(c.train, "epochs", 99),
        lambda c: setattr(c.train, "log_every", 3),
        lambda c: setattr(c.data, "dir", "/data"),
    ):
        assert changed(mutate) == base


def fill(root: Path, name: str, files: dict[str, bytes]) -> Path:
    d = compile_cache.folder(root, name)
    for rel, content in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(content)
    return d


def test_a_sealed_cache_is_warm_and_a_changed_or_unsealed_one_is_set_aside_with_a_warning(tmp_path, warned):
    assert compile_cache.check(tmp_path, "k") == "none"
    d = fill(
        tmp_path,
        "k",
        {"inductor/fx/ab/entry": b"graph", "triton/X/kernel.cubin": b"binary", "inductor/locks/x.lock": b""},
    )
    assert compile_cache.check(tmp_path, "k") == "damaged"  # a start that died mid-compile
    warned(
        r"ignoring the damaged compile cache .*k \(no MANIFEST.json: the start that wrote it stopped while compiling\)"
    )
    assert not d.exists() and not list((tmp_path / compile_cache.FOLDER).iterdir())

    d = fill(
        tmp_path,
        "k",
        {"inductor/fx/ab/entry": b"graph", "triton/X/kernel.cubin": b"binary", "inductor/locks/x.lock": b""},
    )
    assert compile_cache.seal(tmp_path, "k") == len(b"graph") + len(b"binary")  # lock files are not entries
    assert compile_cache.check(tmp_path, "k") == "warm (2 files)"
    (d / "triton/X/kernel.cubin").write_bytes(b"binarz")  # same size, other bytes
    assert compile_cache.check(tmp_path, "k") == "damaged"
    warned(r"triton/X/kernel.cubin is missing or changed\); compiling from scratch")
    assert not d.exists()


def test_use_points_torchs_caches_at_the_keys_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/node/local")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    d = compile_cache.use(tmp_path, "k")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((d / "inductor").resolve()) and os.environ[
        "TRITON_CACHE_DIR"
    ] == str((d / "triton").resolve())
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str((d / "inductor").resolve())  # what inductor itself will use


def test_importing_the_trainer_leaves_the_nodes_inductor_folder_alone(tmp_path):
    # importing torch._dynamo creates TORCHINDUCTOR_CACHE_DIR: before compile_cache.use has pointed
    # it at the volume, that folder is the node's own
    local = tmp_path / "node" / "inductor"
    p = run(
        [
            sys.executable,
            "-c",
            "import trainer.cli, trainer.worker.loop, trainer.worker.parallel, trainer.worker.run, "
            "trainer.worker.optim",
        ],
        env=env(TORCHINDUCTOR_CACHE_DIR=str(local)),
        timeout=120,
    )
    assert p.returncode == 0 and not local.exists(), p.stdout[-2000:]


def test_seal_keeps_the_newest_keys(tmp_path):
    for i in range(compile_cache.KEEP + 1):  # older caches, oldest first
        fill(tmp_path, f"old{i}", {"inductor/e": b"x"})
        compile_cache.seal(tmp_path, f"old{i}")
        manifest = compile_cache.folder(tmp_path, f"old{i}") / compile_cache.MANIFEST
        os.utime(manifest, (time.time() - 100 + i, time.time() - 100 + i))
    fill(tmp_path, "new", {"inductor/e": b"x"})
    compile_cache.seal(tmp_path, "new")
    kept = sorted(p.name for p in (tmp_path / compile_cache.FOLDER).iterdir())
    assert kept == sorted(["new", *(f"old{i}" for i in range(2, compile_cache.KEEP + 1))])


def first_step(ckpt: Path) -> dict:
    return [
        e for e in map(json.loads, (ckpt / "metrics.jsonl").read_text().splitlines()) if e.get("event") == "first_step"
    ][-1]


@pytest.mark.slow
def test_a_restart_on_a_fresh_node_compiles_nothing_and_a_damaged_cache_is_rebuilt(tmp_path):
    ckpt = tmp_path / "ck"

    def train(steps: int, node: str):
        # each "node" has its own empty local inductor and Triton caches: only the volume is shared
        cmd = [
            sys.executable,
            "-m",
            "trainer",
            "train",
            "--config",
            "configs/smoke.yaml",
            "model.compile=true",
            "model.compile_cache=true",
            f"checkpoint.dir={ckpt}",
            f"train.max_steps={steps}",
            "train.plot=false",
            "train.tensorboard=false",
        ]
        return run(
            cmd,
            env=env(
                TORCHINDUCTOR_CACHE_DIR=str(tmp_path / node / "inductor"),
                TRITON_CACHE_DIR=str(tmp_path / node / "triton"),
            ),
            timeout=600,
        )

    p = train(2, "node-a")
    cold = first_step(ckpt)
    assert p.returncode == 0 and cold["compile_cache"] == "none" and cold["compile_cache_bytes"] > 0, p.stdout[-2000:]
    assert "fx_codegen_and_compile" in cold["compile_s"]  # inductor generated and built the kernels
    (d,) = (ckpt / compile_cache.FOLDER).iterdir()
    assert (d / compile_cache.MANIFEST).is_file() and not (
        tmp_path / "node-a" / "inductor"
    ).exists()  # written to the volume

    p = train(4, "node-b")
    warm = first_step(ckpt)
    assert (
        p.returncode == 0 and warm["compile_cache"].startswith("warm (") and f"compile cache {d.name}: warm" in p.stdout
    ), p.stdout[-2000:]
    assert "fx_codegen_and_compile" not in warm["compile_s"]  # every graph came from the volume
    assert (
        cold["graph_cache"]["inductor_miss"] > 0
        and warm["graph_cache"]["inductor_miss"] == 0
        and warm["graph_cache"]["aot_autograd_hit"] > 0
    )

    entry = max(
        (f for f in d.rglob("*") if f.is_file() and f.name != compile_cache.MANIFEST), key=lambda f: f.stat().st_size
    )
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # a torn file on the volume
    p = train(6, "node-c")
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "ignoring the damaged compile cache" in out, out[-2000:]
    rebuilt = first_step(ckpt)
    assert (
        rebuilt["compile_cache"] == "damaged"
        and "fx_codegen_and_compile" in rebuilt["compile_s"]
        and rebuilt["compile_cache_bytes"] > 0
    )
    assert compile_cache.check(ckpt, d.name).startswith("warm (")  # sealed again, whole


def test_a_cache_that_cannot_be_sealed_costs_a_warning_not_the_run(tmp_path, warned):
    (tmp_path / compile_cache.FOLDER).write_text("a file where the folder should be")
    assert compile_cache.seal(tmp_path, "k") == 0
    warned("could not seal the compile cache .*the next start compiles again")
