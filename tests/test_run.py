from __future__ import annotations

import pytest
import torch
from conftest import newest, train, weights

from trainer.config_loader import load_config
from trainer.worker.run import Fast
from trainer.worker.runtime import Runtime

PLAIN = [
    "train.precision=fp32",
    "model.compile=false",
    "model.channels_last=false",
    "data.device_resident=false",
    "optim.impl=loop",
    "checkpoint.async_save=false",
]
FAST_FP32 = [
    "train.precision=fp32",
    "model.compile=true",
    "model.channels_last=true",
    "data.device_resident=true",
    "optim.impl=foreach",
    "checkpoint.async_save=true",
]


def test_fast_path_is_on_for_cuda_and_each_part_switches_off():
    cuda = Runtime("single", 0, 0, 1, torch.device("cuda", 0), None)
    cpu = Runtime("cpu", 0, 0, 1, torch.device("cpu"), None)
    on = Fast.resolve(load_config(), cuda)
    assert on.bf16 and on.channels_last and on.compile and on.device_resident and on.async_save
    off = Fast.resolve(load_config(None, PLAIN), cuda)
    assert not (off.bf16 or off.channels_last or off.compile or off.device_resident or off.async_save)
    assert not Fast.resolve(load_config(), cpu).compile
    dp = Runtime("dp", 0, 0, 1, torch.device("cuda", 0), None)
    assert not Fast.resolve(load_config(), dp).compile  # DataParallel is never compiled


def test_compile_mode_auto_uses_cuda_graphs_where_they_can_be_captured():
    def mode(strategy: str, device: str, *overrides: str) -> Fast:
        rt = Runtime(strategy, 0, 0, 1, torch.device(device, 0) if device == "cuda" else torch.device("cpu"), None)
        return Fast.resolve(load_config(None, ["model.compile=true", *overrides]), rt)

    assert mode("single", "cuda").compile_mode == "reduce-overhead" and mode("single", "cuda").cudagraphs
    assert mode("ddp", "cuda").compile_mode == "reduce-overhead"
    assert mode("fsdp", "cuda").compile_mode == "default" and not mode("fsdp", "cuda").cudagraphs
    assert mode("cpu", "cpu").compile_mode == "default"
    assert mode("single", "cuda", "model.compile_mode=default").compile_mode == "default"  # an explicit mode stays
    assert "compile (reduce-overhead)" in str(mode("single", "cuda"))
    assert not mode("single", "cuda", "model.compile=false").cudagraphs


def relative(a: dict, b: dict) -> float:
    num = sum(float((a[k].float() - b[k].float()).norm() ** 2) for k in a)
    den = sum(float(b[k].float().norm() ** 2) for k in b)
    return (num / den) ** 0.5


@pytest.mark.slow
def test_fast_and_plain_paths_compute_the_same(tmp_path):
    """compile + channels-last + foreach + data on the device + async saves change no result beyond
    float rounding; bf16 autocast on top stays within bf16 tolerance (not compiled here: inductor's
    CPU compile of a second graph took 2.5 of CI's minutes; the GPU suite resumes compiled bf16 runs)."""
    common = ["train.epochs=1", "train.max_steps=8", "optim.momentum=0.9", "data.crop_padding=4"]
    train(tmp_path / "plain", *common, *PLAIN, timeout=600)
    train(tmp_path / "fast32", *common, *FAST_FP32, timeout=600)
    train(tmp_path / "fast16", *common, *FAST_FP32[2:], "model.compile=false", "train.precision=bf16", timeout=600)
    plain = weights(newest(tmp_path / "plain"))
    assert relative(weights(newest(tmp_path / "fast32")), plain) < 1e-4
    bf16 = relative(weights(newest(tmp_path / "fast16")), plain)
    assert 0 < bf16 < 3e-2


def test_param_dtype_auto_takes_bf16_weights_only_where_they_work():
    def weights(strategy: str, device: str, *overrides: str) -> bool:
        rt = Runtime(strategy, 0, 0, 1, torch.device(device, 0) if device == "cuda" else torch.device("cpu"), None)
        return Fast.resolve(load_config(None, ["train.param_dtype=auto", *overrides]), rt).bf16_weights

    assert weights("single", "cuda") and weights("ddp", "cuda")
    assert not weights("cpu", "cpu")  # autocast is off on the CPU by default
    assert weights("cpu", "cpu", "train.precision=bf16")
    assert not weights("fsdp", "cuda") and not weights("dp", "cuda")
    assert not weights("single", "cuda", "optim.name=adamw") and not weights(
        "single", "cuda", "optim.lookahead_every=5"
    )
    assert not weights("single", "cuda", "train.precision=fp32")
    assert not Fast.resolve(
        load_config(), Runtime("single", 0, 0, 1, torch.device("cuda", 0), None)
    ).bf16_weights  # the default: fp32


def test_what_a_resolved_strategy_cannot_run_is_refused_naming_the_fix():
    from trainer.config import ConfigError

    def resolve(strategy: str, *overrides: str) -> Fast:
        return Fast.resolve(load_config(None, list(overrides)), Runtime(strategy, 0, 0, 1, torch.device("cpu"), None))

    with pytest.raises(ConfigError, match="set optim.lookahead_every=0 or use ddp"):
        resolve("fsdp", "optim.lookahead_every=5")
    with pytest.raises(ConfigError, match="use model.compile=false"):
        resolve("dp", "model.compile=true")
    assert resolve("ddp", "optim.lookahead_every=5") and resolve("fsdp")
