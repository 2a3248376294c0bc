from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import ROOT, TINY, env, free_port, run, torchrun_cmd, train, trainer_cmd, tree_files, weights

from trainer.config import ConfigError
from trainer.config_loader import load_config
from trainer.worker.runtime import check_batch, resolve

DIST_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for k in DIST_ENV:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_auto_is_the_cpu_alone_and_ddp_under_torchrun(no_cuda):
    assert resolve(load_config()).strategy == "cpu"
    for k, v in DIST_ENV.items():
        no_cuda.setenv(k, v)
    rt = resolve(load_config())
    assert (rt.strategy, rt.rank, rt.local_rank, rt.world_size, rt.backend, rt.device.type) == (
        "ddp",
        1,
        1,
        2,
        "gloo",
        "cpu",
    )
    assert not rt.is_main


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.strategy=single"], "needs a CUDA GPU"),
        (["train.strategy=dp"], "needs a CUDA GPU"),
        (["train.strategy=ddp"], "needs the environment torchrun sets"),
        (["train.strategy=cpu", "dist.backend=nccl"], "dist.backend=nccl"),
    ],
)
def test_impossible_strategies_alone(no_cuda, overrides, words):
    with pytest.raises(ConfigError, match=words):
        resolve(load_config(None, overrides))


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["dist.backend=nccl"], "dist.backend=nccl needs CUDA GPUs"),
        (["train.device=cuda"], "train.device=cuda but no CUDA GPU"),
        (["train.strategy=cpu"], "runs one process but torchrun started 2"),
    ],
)
def test_impossible_strategies_under_torchrun(no_cuda, overrides, words):
    for k, v in DIST_ENV.items():
        no_cuda.setenv(k, v)
    with pytest.raises(ConfigError, match=words):
        resolve(load_config(None, overrides))


def test_batch_must_cover_and_divide_the_world(no_cuda):
    for k, v in DIST_ENV.items():
        no_cuda.setenv(k, v)
    world = resolve(load_config()).world_size
    with pytest.raises(ConfigError, match="smaller than the world size 2"):
        check_batch(load_config(None, ["train.batch_size=1"]), world)
    with pytest.raises(ConfigError, match="not a multiple of the world size 2; use 4 or 6"):
        check_batch(load_config(None, ["train.batch_size=5"]), world)


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_gpu_strategies_fail_cleanly_on_a_cpu_machine(tmp_path, strategy):
    p = run(trainer_cmd("train", *TINY, f"checkpoint.dir={tmp_path / 'ck'}", f"train.strategy={strategy}"), check=False)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr and "Traceback" not in p.stderr
    assert tree_files(tmp_path / "ck") == {}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_stay_identical_and_equal_one_process(tmp_path, strategy):
    # A few steps, in float64 (tests/ddp_probe.py): the only difference left is the order of the
    # gradient sums, ~1e-16 relative, so a tight tolerance holds on any CPU and a real bug (a
    # gradient averaged twice, a skipped batch) is ~1e-2 off.
    args = [*TINY, "train.epochs=1", "train.max_steps=6", "optim.momentum=0.9", "data.crop_padding=4"]
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    run([sys.executable, "tests/ddp_probe.py", str(one), *args, f"checkpoint.dir={tmp_path / 'a'}"])
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "tests/ddp_probe.py",
            str(two),
            *args,
            f"checkpoint.dir={tmp_path / 'b'}",
            f"train.strategy={strategy}",
        ],
        env=env(MASTER_PORT=str(free_port())),
    )
    a, b = torch.load(one), torch.load(two)
    assert b["max_rank_diff"] == 0.0, "ranks diverged"
    assert a["flat"].dtype == torch.float64 and not torch.equal(a["flat"], torch.zeros_like(a["flat"]))
    torch.testing.assert_close(b["flat"], a["flat"], rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_only_rank_zero_prints_and_writes(tmp_path, ckpt):
    logs = tmp_path / "logs"
    cmd = torchrun_cmd(
        2, "train", *TINY, f"checkpoint.dir={ckpt}", "train.epochs=1", extra=(f"--log-dir={logs}", "--redirects=3")
    )
    run(cmd)
    outs = {p.parent.name: p.read_text() for p in logs.rglob("stdout.log")}
    assert "epoch 1/1" in outs["0"] and outs["1"].strip() == ""
    lines = (ckpt / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines)) and sum('"event": "epoch"' in line for line in lines) == 1
    keys = weights(ckpt / "step-16").keys()
    assert keys and not any(k.startswith(("module.", "_orig_mod.")) for k in keys)


@pytest.mark.slow
def test_multi_node_rendezvous_on_one_host(tmp_path, ckpt):
    """Two torchrun 'nodes' (one process each) meet through c10d rendezvous, no code change."""
    import subprocess

    port = free_port()
    cmds = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={i}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=job1",
            "-m",
            "trainer",
            "train",
            *TINY,
            f"checkpoint.dir={ckpt}",
            "train.epochs=1",
        ]
        for i in range(2)
    ]
    procs = [
        subprocess.Popen(c, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in cmds
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "strategy ddp x2" in "".join(outs) and (ckpt / "step-16").is_dir()


@pytest.mark.slow
def test_legacy_torch_distributed_launch_still_works(ckpt):
    """The article's launcher passes --local-rank=N to the module; it is accepted."""
    p = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.launch",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            "-m",
            "trainer",
            "train",
            *TINY,
            f"checkpoint.dir={ckpt}",
            "train.epochs=1",
        ]
    )
    assert "strategy ddp x2" in p.stdout and (ckpt / "step-16").is_dir()


def test_a_plain_process_trains_alone_on_the_cpu_without_a_process_group(ckpt):
    """No launcher at all (the article's first part): strategy cpu, world size 1, no rendezvous."""
    p = train(ckpt, "train.epochs=1")
    assert "strategy cpu x1 on cpu" in p.stdout and (ckpt / "step-16" / "meta.json").is_file()
    start = next(json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines() if '"start"' in line)
    assert (start["strategy"], start["world_size"]) == ("cpu", 1)
