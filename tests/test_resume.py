"""A resumed run is the run that saved it, tensor for tensor: values, dtype, device and memory
format (strides) of every weight, buffer, optimizer state and Lookahead copy, for synchronous and
asynchronous saves, channels-last on and off, each optimizer kernel, fp32 and bf16, one process,
DDP and FSDP. On the CPU the continued run also ends bit-identical to one never stopped.

tests/test_gpu.py runs the same matrix on CUDA (fused optimizers, pinned snapshots, NCCL)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, as_format1, env, free_port, run, write_format1
from conftest import saved as saved_state

PROBE = "tests/resume_probe.py"
BASE = [
    *TINY,
    "train.epochs=2",
    "checkpoint.every_steps=5",
    "checkpoint.keep=10",
    "optim.momentum=0.9",
    "data.crop_padding=4",
]
RESUME_AT = 10  # a mid-epoch periodic save (asynchronous when async_save is on), not the final one


def probe(out: Path, args: list[str], nproc: int, extra_env: dict | None = None) -> dict:
    if nproc == 1:
        cmd = [sys.executable, PROBE, str(out), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            PROBE,
            str(out),
            *args,
        ]
    run(cmd, env=env(MASTER_PORT=str(free_port()), **(extra_env or {})), timeout=600)
    return torch.load(out, weights_only=False)


def stride_of(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride())


def check_resume(
    tmp_path: Path, overrides: list[str], nproc: int = 1, exact: bool = True, extra_env: dict | None = None
) -> tuple[dict, dict]:
    """Train a reference run; resume a copy of its step-10 checkpoint in a fresh folder; compare."""
    args = [*BASE, *overrides]
    ref = probe(tmp_path / "ref.pt", [*args, f"checkpoint.dir={tmp_path / 'a'}"], nproc, extra_env)
    shutil.copytree(tmp_path / "a" / f"step-{RESUME_AT}", tmp_path / "b" / f"step-{RESUME_AT}")
    res = probe(tmp_path / "res.pt", [*args, f"checkpoint.dir={tmp_path / 'b'}"], nproc, extra_env)
    assert (
        not ref["resumed"] and res["resumed"] and ref["step"] == res["step"] == 32 and ref["code"] == res["code"] == 0
    )

    # 1. every restored tensor has the live run's dtype, device, shape and strides
    if "optim.momentum=0" not in overrides:  # SGD without momentum keeps no state per parameter
        assert any(k.startswith("optimizer/") for k in res["restored"]), "no optimizer state was restored"
    differ = {k: (res["restored"].get(k), v) for k, v in ref["final"].items() if res["restored"].get(k) != v}
    assert not differ, f"restored layout differs from the live run's (restored, live): {differ}"

    # 2. training goes on to the same end
    assert ref["values"].keys() == res["values"].keys()
    for k, a in ref["values"].items():
        b = res["values"][k]
        assert a.dtype == b.dtype, k
        if exact:
            assert torch.equal(a, b), (
                f"{k} differs from the never-stopped run (max abs diff "
                f"{(a.double() - b.double()).abs().max().item():.3g})"
            )
        else:
            assert torch.isfinite(b.float()).all(), k
    return ref, res


FAST = {
    "async-channels_last-foreach": ["checkpoint.async_save=true", "model.channels_last=true", "optim.impl=foreach"],
    "sync-contiguous-loop": ["checkpoint.async_save=false", "model.channels_last=false", "optim.impl=loop"],
    # bf16 working weights, fp32 masters (and their momentum) in the checkpoint
    "async-channels_last-bf16-weights": [
        "checkpoint.async_save=true",
        "model.channels_last=true",
        "train.precision=bf16",
        "train.param_dtype=bf16",
    ],
    # seed.yaml's optimizer: SGD without momentum has no state per parameter, only its groups' settings
    "async-bf16-weights-no-momentum": [
        "checkpoint.async_save=true",
        "train.precision=bf16",
        "train.param_dtype=bf16",
        "optim.momentum=0",
        "optim.nesterov=false",
    ],
}
SLOW = {
    "sync-channels_last-foreach": ["checkpoint.async_save=false", "model.channels_last=true", "optim.impl=foreach"],
    "async-contiguous-loop": ["checkpoint.async_save=true", "model.channels_last=false", "optim.impl=loop"],
    "async-channels_last-lookahead": [
        "checkpoint.async_save=true",
        "model.channels_last=true",
        "optim.lookahead_every=3",
    ],
    "async-channels_last-adamw-bf16": [
        "checkpoint.async_save=true",
        "model.channels_last=true",
        "optim.name=adamw",
        "train.precision=bf16",
    ],
}


@pytest.mark.parametrize("case", FAST)
def test_resume_is_exact_one_process(tmp_path, case):
    check_resume(tmp_path, FAST[case])


@pytest.mark.parametrize(
    "saved, now", [("0.9", "0"), ("0", "0.9")], ids=["momentum-switched-off", "momentum-switched-on"]
)
def test_a_resume_with_other_optim_settings_runs_with_them(tmp_path, saved, now):
    """The checkpoint's optimizer state under this run's settings: momentum buffers dropped when
    momentum is now 0 (torch's loader failed on them), started when it is now on; the weight decay
    given now applies too, and the learning rate stays the schedule's."""
    from conftest import trainer_cmd

    ck, no_nesterov = tmp_path / "ck", "optim.nesterov=false"
    common = [
        *TINY,
        "train.epochs=2",
        "checkpoint.every_steps=4",
        "checkpoint.async_save=false",
        no_nesterov,
        f"checkpoint.dir={ck}",
    ]
    run(trainer_cmd("train", *common, "train.max_steps=8", f"optim.momentum={saved}"))
    p = run(trainer_cmd("train", *common, "train.max_steps=12", f"optim.momentum={now}", "optim.weight_decay=0.001"))
    assert "resuming from" in p.stdout and "step-8" in p.stdout, p.stdout[-2000:]
    before, after = saved_state(ck / "step-8")["optimizer"], saved_state(ck / "step-12")["optimizer"]
    assert {g["momentum"] for g in before["param_groups"]} == {float(saved)}
    assert {g["momentum"] for g in after["param_groups"]} == {float(now)}
    assert {g["weight_decay"] for g in after["param_groups"] if g["weight_decay"]} == {0.001}
    buffers = [
        k for st in after["state"].values() for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    assert bool(buffers) == (now != "0"), buffers


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW)
def test_resume_is_exact_one_process_more(tmp_path, case):
    check_resume(tmp_path, SLOW[case])


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, overrides",
    [
        ("ddp", ["checkpoint.async_save=true", "model.channels_last=true"]),
        ("ddp", ["checkpoint.async_save=false", "model.channels_last=true", "optim.lookahead_every=3"]),
        ("fsdp", ["checkpoint.async_save=true"]),
        # bf16 all-reduce
        (
            "ddp",
            [
                "checkpoint.async_save=true",
                "model.channels_last=true",
                "train.precision=bf16",
                "train.param_dtype=bf16",
            ],
        ),
        # the Linear's gradient from gathered factors, with bf16 weights
        (
            "ddp",
            [
                "checkpoint.async_save=true",
                "model.channels_last=true",
                "train.precision=bf16",
                "train.param_dtype=bf16",
                "dist.gather_linear_factors=true",
            ],
        ),
        # seed.yaml's SGD: no state per parameter
        (
            "ddp",
            ["checkpoint.async_save=true", "optim.momentum=0", "optim.nesterov=false"],
        ),
    ],
)
def test_resume_is_exact_two_ranks(tmp_path, strategy, overrides):
    check_resume(tmp_path, [f"train.strategy={strategy}", *overrides], nproc=2)


def test_format_1_checkpoints_with_dense_momentum_resume_in_the_parameters_layout(tmp_path):
    """A checkpoint of format 1 (one state.pt, before DCP), written before snapshots kept strides
    (momentum stored NCHW-contiguous for a channels-last weight), still resumes, exactly, with
    every buffer in its parameter's layout."""
    args = [*BASE, "model.channels_last=true", "checkpoint.async_save=false"]
    ref = probe(tmp_path / "ref.pt", [*args, f"checkpoint.dir={tmp_path / 'a'}"], 1)
    folder = tmp_path / "a" / f"step-{RESUME_AT}"
    state = as_format1(folder)  # read back whole: every tensor NCHW-contiguous
    live = [k for k, (_, _, shape, stride) in ref["final"].items() if k.startswith("optimizer/") and len(shape) == 4]
    assert live and all(ref["final"][k][3] != torch.empty(ref["final"][k][2]).stride() for k in live), (
        "the run should have channels-last momentum"
    )
    assert all(
        v.is_contiguous()
        for st in state["optimizer"]["state"].values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    write_format1(state, tmp_path / "b", RESUME_AT)
    res = probe(tmp_path / "res.pt", [*args, f"checkpoint.dir={tmp_path / 'b'}"], 1)
    assert res["restored"] == ref["final"]
    for k, a in ref["values"].items():
        assert torch.equal(a, res["values"][k]), k


@pytest.mark.slow
def test_fsdp_shards_resume_in_one_process_and_back_and_trainer_eval_reads_them(tmp_path):
    """DCP reshards: two fsdp ranks each write their shard; one process resumes from them, two fsdp
    ranks resume from that one process's checkpoint, and `trainer eval` reads the sharded one whole."""
    from conftest import torchrun_cmd, trainer_cmd

    ck = tmp_path / "ck"
    common = [*TINY, "train.epochs=2", f"checkpoint.dir={ck}", "checkpoint.every_steps=4", "optim.momentum=0.9"]
    run(torchrun_cmd(2, "train", *common, "train.strategy=fsdp", "train.max_steps=8"), env=env())
    assert len(list((ck / "step-8").glob("*.distcp"))) == 2, "each rank writes its own shard"
    whole = saved_state(ck / "step-8")["model"]
    from trainer.worker import models

    assert {k: tuple(t.shape) for k, t in whole.items()} == {
        k: tuple(t.shape) for k, t in models.build("tinynet").state_dict().items()
    }
    p = run(trainer_cmd("train", *common, "train.max_steps=12"))
    assert "resuming from" in p.stdout and "step-8" in p.stdout and "strategy cpu x1" in p.stdout, p.stdout[-2000:]
    p = run(torchrun_cmd(2, "train", *common, "train.strategy=fsdp", "train.max_steps=16"))
    assert "resuming from" in p.stdout and "step-12" in p.stdout and "done: step 16" in p.stdout, p.stdout[-2000:]
    e = run(trainer_cmd("eval", str(ck / "step-8")))
    assert "test accuracy" in e.stdout, e.stdout + e.stderr
