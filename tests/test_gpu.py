"""The GPU suite: what the CPU CI cannot see (fused optimizers, pinned-memory snapshots, NCCL, CUDA
graphs and compiled graphs across a resume; faults on real GPUs). Run it on a machine with two
GPUs whenever GPU-path code changes, with the CIFAR-10 tarballs in GPU_DATA (default .devdata):

    python -m pytest -m gpu tests/test_gpu.py          # GPU_REPORT=file.jsonl keeps the figures

Deselected by `make test`/`make test-slow` (-m "not gpu"); skipped where no CUDA GPU is visible.
Each fault case records the recovery time: from the fault to the first training step after it
(the restarted group's warm-up forward-backward, logged as ``first_step`` in metrics.jsonl).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import BF16_DDP, ROOT, TINY, env, gpu_figure, same_training, spawn, worker
from test_resume import check_resume

GPUS = torch.cuda.device_count()
NPROC = min(GPUS, 2)  # the fault cases run on two GPUs; on a one-GPU machine, one rank (no hang case)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")

DATA = Path(os.environ.get("GPU_DATA", ROOT / ".devdata"))
CACHE = os.environ.get("GPU_CACHE", "/dev/shm/trainer-gpu-cache")
EPOCHS = 8
TIMEOUT_S = 30
# ResNet-18 (the default recipe), shortened; a checkpoint every 25 steps as well as every epoch
REAL = [
    "--config",
    "configs/default.yaml",
    "data.name=imagefolder",
    f"data.dir={DATA}",
    f"data.cache_dir={CACHE}",
    f"train.epochs={EPOCHS}",
    "train.plot=false",
    "train.log_every=25",
    "checkpoint.every_steps=25",
    f"dist.timeout_s={TIMEOUT_S}",
]
# The spread of these 8-epoch ResNet-18 runs (cuDNN's autotuned kernels are not deterministic, so a
# resumed run is not bit for bit): in bench/results' one-GPU suites of 2026-12-02 and 03, 32 end
# accuracies from 0.8042 to 0.8395 and references from 0.819 to 0.8373, the widest gap to its own
# reference 2.7 points. 3.5 points is past all of it; a broken resume (a lost optimizer state, a
# wrong learning rate) costs far more.
ACC_NOISE = 0.035


def gpu_env(**extra: str) -> dict[str, str]:
    e = env(
        CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(GPUS)),
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    e.update(extra)
    return e


def report(case: str, **figures) -> None:
    row = {
        "case": case,
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0),
        "gpus": GPUS,
        "torch": torch.__version__,
        **figures,
    }
    print("GPU-REPORT " + json.dumps(row))
    gpu_figure(row)  # the table at the end of the run (conftest.py)
    if os.environ.get("GPU_REPORT"):
        with open(os.environ["GPU_REPORT"], "a") as fh:
            fh.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------------------------
# The resume matrix on CUDA (tiny model, synthetic data, deterministic kernels)

ONE_GPU = {
    "async-channels_last-fused-bf16": [
        "checkpoint.async_save=true",
        "model.channels_last=true",
        "optim.impl=fused",
        "model.compile=false",
    ],
    "sync-channels_last-fused-fp32": [
        "checkpoint.async_save=false",
        "model.channels_last=true",
        "optim.impl=fused",
        "train.precision=fp32",
        "model.compile=false",
    ],
    "async-contiguous-foreach-bf16-compiled": [
        "checkpoint.async_save=true",
        "model.channels_last=false",
        "optim.impl=foreach",
        "model.compile=true",
    ],
    "async-channels_last-loop-fp32-compiled": [
        "checkpoint.async_save=true",
        "model.channels_last=true",
        "optim.impl=loop",
        "train.precision=fp32",
        "model.compile=true",
    ],
    "async-channels_last-adamw-fused-bf16": [
        "checkpoint.async_save=true",
        "model.channels_last=true",
        "optim.name=adamw",
        "optim.impl=fused",
        "model.compile=false",
    ],
    "async-channels_last-fused-lookahead-cudagraphs": [
        "checkpoint.async_save=true",
        "model.channels_last=true",
        "optim.lookahead_every=3",
        "model.compile=true",
        "model.compile_mode=reduce-overhead",
    ],
    # bf16 working weights with fp32 masters, compiled; then seed.yaml's SGD without momentum (no
    # optimizer state per parameter: its resume failed on every device until 2026-12-02)
    "async-channels_last-bf16-weights-compiled": [
        "checkpoint.async_save=true",
        "model.channels_last=true",
        "train.param_dtype=bf16",
        "model.compile=true",
    ],
    "async-bf16-weights-no-momentum-compiled": [
        "checkpoint.async_save=true",
        "train.param_dtype=bf16",
        "model.compile=true",
        "optim.momentum=0",
        "optim.nesterov=false",
    ],
}
TWO_GPUS = {
    "ddp-async-channels_last-fused-bf16-compiled": [
        "train.strategy=ddp",
        "checkpoint.async_save=true",
        "model.channels_last=true",
        "model.compile=true",
    ],
    "ddp-sync-channels_last-fused-fp32-lookahead": [
        "train.strategy=ddp",
        "checkpoint.async_save=false",
        "model.channels_last=true",
        "train.precision=fp32",
        "optim.lookahead_every=3",
        "model.compile=false",
    ],
    "fsdp-async-foreach-bf16": ["train.strategy=fsdp", "checkpoint.async_save=true", "model.compile=false"],
    # bf16 working weights: bf16 all-reduce, CUDA graphs (compile_mode auto), the compiled master
    # update after backward; and the Linear layer's gradient from all-gathered factors (eager,
    # between the compiled pieces)
    "ddp-async-channels_last-bf16-weights-compiled": [
        "train.strategy=ddp",
        "checkpoint.async_save=true",
        "model.channels_last=true",
        "train.param_dtype=bf16",
        "model.compile=true",
    ],
    "ddp-bf16-weights-compiled-gathered": [
        "train.strategy=ddp",
        "checkpoint.async_save=false",
        "model.channels_last=true",
        "train.param_dtype=bf16",
        "model.compile=true",
        "dist.gather_linear_factors=true",
    ],
}


@pytest.mark.parametrize("case", ONE_GPU)
def test_resume_is_exact_on_one_gpu(tmp_path, case):
    t0 = time.time()
    check_resume(tmp_path, ["train.device=cuda", *ONE_GPU[case]], nproc=1, extra_env=gpu_env(CUDA_VISIBLE_DEVICES="0"))
    report(f"resume matrix, 1 GPU: {case}", result="pass", seconds=round(time.time() - t0, 1))


@two_gpus
@pytest.mark.parametrize("case", TWO_GPUS)
def test_resume_is_exact_on_two_gpus(tmp_path, case):
    t0 = time.time()
    check_resume(
        tmp_path, ["train.device=cuda", *TWO_GPUS[case]], nproc=2, extra_env=gpu_env(CUDA_VISIBLE_DEVICES="0,1")
    )
    report(f"resume matrix, 2 GPUs: {case}", result="pass", seconds=round(time.time() - t0, 1))


# ------------------------------------------------------------------------------------------------
# Faults on two GPUs (one where only one is visible), through `trainer launch` (the supervisor
# every launcher uses)


def launch(ckpt: Path, *overrides: str, extra_env: dict | None = None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "launch",
        "--nproc-per-node",
        str(NPROC),
        *REAL,
        f"checkpoint.dir={ckpt}",
        *overrides,
    ]
    return spawn(cmd, gpu_env(**(extra_env or {})))


def follow(
    agent: subprocess.Popen, when: str | None = None, act=None, timeout: float = 540
) -> tuple[str, float | None]:
    """Read the job's output to its end; the first line containing ``when`` triggers ``act()``.
    Returns the output and the time of the act."""
    lines, acted_at, deadline = [], None, time.time() + timeout
    for line in agent.stdout:
        lines.append(line)
        if when and acted_at is None and when in line:
            act()
            acted_at = time.time()
        if time.time() > deadline:
            agent.kill()
            break
    agent.wait(60)
    return "".join(lines), acted_at


def events(ckpt: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("event") == kind]


def final_acc(ckpt: Path) -> float:
    return events(ckpt, "epoch")[-1]["test_acc"]


def first_step_after(ckpt: Path, since: float) -> dict:
    """The first_step record of the first start after ``since`` (its phases, its compile caches)."""
    after = [r for r in events(ckpt, "first_step") if r["time"] > since]
    assert after, "no training step after the fault"
    return after[0]


def recovery_s(ckpt: Path, since: float) -> float:
    return round(first_step_after(ckpt, since)["time"] - since, 1)


@two_gpus
def test_linear_gradients_from_gathered_factors_on_two_gpus_match_ddps(tmp_path):
    """NCCL: the all-gathers of dist.gather_linear_factors (one started in forward, waited in
    backward), eager between compiled CUDA-graph pieces, with bf16 weights and their masters."""
    # bf16 gradients rounded after the sum (tests/test_parallel.py)
    same_training(
        tmp_path,
        [*TINY, *BF16_DDP, "train.device=cuda", "model.compile=true", "optim.momentum=0.9"],
        "dist.gather_linear_factors",
        gpu_env(CUDA_VISIBLE_DEVICES="0,1"),
        rtol=5e-2,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> float:
    ckpt = tmp_path_factory.mktemp("reference") / "ck"
    t0 = time.time()
    out, _ = follow(launch(ckpt, "model.compile=false"))
    assert f"done: step {EPOCHS * 97}" in out, out[-3000:]
    acc = final_acc(ckpt)
    report(
        f"uninterrupted 8-epoch ResNet-18, {NPROC} GPU(s), compile off",
        test_acc=acc,
        seconds=round(time.time() - t0, 1),
    )
    return acc


MID_EPOCH_2 = f"epoch 2/{EPOCHS} step 53/97"  # global step 150 (97 steps an epoch at batch 512)


# compiled twice: its recovery (target 10 s) has varied by seconds from one suite run to the next
@pytest.mark.parametrize("compiled", [False, True, True], ids=["eager", "compiled", "compiled-again"])
def test_kill_9_of_one_rank_restarts_the_group_and_finishes(tmp_path, reference, compiled):
    ckpt = tmp_path / "ck"
    agent = launch(ckpt, f"model.compile={str(compiled).lower()}")
    out, killed_at = follow(agent, MID_EPOCH_2, lambda: worker(agent, NPROC - 1).send_signal(signal.SIGKILL))
    assert killed_at and agent.returncode == 0, out[-3000:]
    assert "resuming from" in out and "fused_sgd" not in out, out[-3000:]
    acc, restart = final_acc(ckpt), first_step_after(ckpt, killed_at)
    report(
        f"kill -9 of rank {NPROC - 1} of {NPROC} mid-epoch 2, compile {'on' if compiled else 'off'}",
        result="finished",
        exit=agent.returncode,
        recovery_s=round(restart["time"] - killed_at, 1),
        worker_first_step_s=restart["seconds"],
        startup_s=restart["startup_s"],
        graph_cache=restart["graph_cache"],
        test_acc=acc,
        reference_acc=reference,
    )
    assert abs(acc - reference) <= ACC_NOISE
    if compiled:  # the restarted worker found every graph's code in the compile cache
        assert restart["graph_cache"]["inductor_miss"] == 0, restart["graph_cache"]


def test_sigterm_gives_75_and_a_relaunch_finishes(tmp_path, reference):
    ckpt = tmp_path / "ck"
    agent = launch(ckpt, "model.compile=false")
    out, stopped_at = follow(agent, MID_EPOCH_2, lambda: agent.send_signal(signal.SIGTERM))
    assert agent.returncode == 75, out[-3000:]
    step = max(int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if p.name.split("-")[1].isdigit())
    assert 97 + 50 <= step < 2 * 97, f"the stop checkpoint should be of the step it stopped at, got step-{step}"
    t_relaunch = time.time()
    again = launch(ckpt, "model.compile=false")
    out2, _ = follow(again)
    assert again.returncode == 0 and f"resuming from {ckpt}/step-{step}" in out2, out2[-3000:]
    acc = final_acc(ckpt)
    report(
        f"SIGTERM to trainer launch ({NPROC} GPU(s)) mid-epoch 2, then relaunch",
        result="finished",
        exit_first=75,
        saved_step=step,
        stop_s=round(t_relaunch - stopped_at, 1),
        relaunch_to_first_step_s=recovery_s(ckpt, t_relaunch),
        test_acc=acc,
        reference_acc=reference,
    )
    assert abs(acc - reference) <= ACC_NOISE


# The stated margin over dist.timeout_s, term by term as measured on 2x H200 with torch 2.11
# (bench/hang.py, 2026-11-30; RELIABILITY.md): the healthy rank's NCCL watchdog fires at the
# timeout and takes the process down (dist.setup turns off the 60 s wait for a debug dump that
# torch otherwise adds here); torchrun then sends the hung rank SIGTERM, which a stopped process
# cannot act on, and SIGKILLs it 30 s later; the new group reaches its first step ~12 s after that.
# 30 + 12, plus room for a slower start.
HANG_MARGIN_S = 30 + 12 + 18


@two_gpus
def test_a_hung_rank_is_detected_and_the_restart_finishes(tmp_path, reference):
    ckpt = tmp_path / "ck"
    agent = launch(ckpt, "model.compile=false")
    out, stopped_at = follow(agent, MID_EPOCH_2, lambda: worker(agent, 1).send_signal(signal.SIGSTOP))
    assert stopped_at and agent.returncode == 0, out[-3000:]
    assert "resuming from" in out
    acc, rec = final_acc(ckpt), recovery_s(ckpt, stopped_at)
    report(
        "SIGSTOP of rank 1 mid-epoch 2 (a hung rank)",
        result="finished",
        exit=agent.returncode,
        recovery_s=rec,
        bound_s=TIMEOUT_S + HANG_MARGIN_S,
        test_acc=acc,
        reference_acc=reference,
    )
    assert rec <= TIMEOUT_S + HANG_MARGIN_S
    assert abs(acc - reference) <= ACC_NOISE


# The hang watchdog (dist.hang_timeout_s) on the GPU: a worker that cannot act (SIGSTOP) is killed
# by the supervisor at the bound plus its 10 s margin; one whose data read blocks writes its stacks
# and exits 124 at the bound. Either way torchrun restarts the group, also with a single GPU, where
# no collective times out.
HANG_BOUND_S = 20


def test_a_stopped_worker_is_caught_by_the_hang_watchdog_and_the_restart_finishes(tmp_path, reference):
    ckpt = tmp_path / "ck"
    agent = launch(
        ckpt, "model.compile=false", f"dist.hang_timeout_s={HANG_BOUND_S}", f"dist.timeout_s={10 * HANG_BOUND_S}"
    )
    out, stopped_at = follow(agent, MID_EPOCH_2, lambda: worker(agent, NPROC - 1).send_signal(signal.SIGSTOP))
    assert stopped_at and agent.returncode == 0 and "resuming from" in out, out[-3000:]
    assert ", stopped) has made no progress" in out and (ckpt / f"hang-rank{NPROC - 1}.txt").is_file()
    acc, rec = final_acc(ckpt), recovery_s(ckpt, stopped_at)
    report(
        f"SIGSTOP of rank {NPROC - 1} of {NPROC} mid-epoch 2, hang watchdog {HANG_BOUND_S} s",
        result="finished",
        exit=agent.returncode,
        recovery_s=rec,
        bound_s=HANG_BOUND_S + 30,
        test_acc=acc,
        reference_acc=reference,
    )
    assert rec <= HANG_BOUND_S + 30
    assert abs(acc - reference) <= ACC_NOISE


def test_a_blocked_data_read_leaves_stacks_and_the_restart_finishes(tmp_path, reference):
    ckpt = tmp_path / "ck"
    # the read after step 150 blocks on rank 0
    agent = launch(
        ckpt,
        "model.compile=false",
        f"dist.hang_timeout_s={HANG_BOUND_S}",
        f"dist.timeout_s={10 * HANG_BOUND_S}",
        extra_env={"TRAINER_FAULT": "batch@151:sleep=900"},
    )
    out, hung_at = follow(agent, MID_EPOCH_2, lambda: None)
    assert hung_at and agent.returncode == 0 and "resuming from" in out, out[-3000:]
    stacks = (ckpt / "hang-rank0.txt").read_text()
    assert "after step 150" in stacks and "crash_point" in stacks and "train_epoch" in stacks
    record = ckpt / "nccl-trace-rank0"  # NCCL's flight recorder, dumped when the watchdog fired and named by its line
    assert f"NCCL flight record in {record}" in out and "version" in pickle.loads(record.read_bytes()), out[-3000:]
    acc, rec = final_acc(ckpt), recovery_s(ckpt, hung_at)
    report(
        f"a data read that blocks on rank 0 of {NPROC} after step 150, hang watchdog {HANG_BOUND_S} s",
        result="finished",
        exit=agent.returncode,
        recovery_s=rec,
        bound_s=HANG_BOUND_S + 30,
        test_acc=acc,
        reference_acc=reference,
    )
    assert rec <= HANG_BOUND_S + 30
    assert abs(acc - reference) <= ACC_NOISE


# ------------------------------------------------------------------------------------------------
# Restarts: every shipped config, compiled, cold then warm on a "fresh node" (empty HOME and
# TMPDIR: no inductor, Triton or CUDA caches; only the volume is shared), timed from the
# `trainer launch` command as `trainer bench --suite restart` does (the same function). The figures
# go to the report; the speed target is BENCHMARKS.md's business, this checks that the restarted
# run finds every graph in the cache and trains on from its checkpoint.


@pytest.mark.parametrize("config", ["configs/default.yaml", "configs/fast.yaml", "configs/seed.yaml"])
def test_a_restart_on_a_fresh_node_finds_its_checkpoint_and_compile_cache(tmp_path, config):
    from bench.run import restart_pair

    trace = (
        Path(os.environ["GPU_REPORT"]).parent / f"trace-{Path(config).stem}"
        if os.environ.get("GPU_REPORT")
        else tmp_path / "trace"
    )
    node_env = {node: {"TORCH_TRACE": str(trace / node)} for node in ("cold", "warm")} if "seed" in config else None
    cold, warm = restart_pair(tmp_path, NPROC, config, str(DATA), logs=tmp_path / "logs", node_env=node_env)
    assert cold["exit"] == 0, cold.get("output")
    assert warm["exit"] == 0, warm.get("output")  # the restart resumed from the cold start's checkpoint and trained
    report(
        f"restart on a fresh node, {config}, {NPROC} GPU(s)",
        cold_command_s=cold["command_to_first_step_s"],
        warm_command_s=warm["command_to_first_step_s"],
        ratio=round(warm["command_to_first_step_s"] / cold["command_to_first_step_s"], 3),
        cold_worker_s=cold["worker_first_step_s"],
        warm_worker_s=warm["worker_first_step_s"],
        found=warm["compile_cache"],
        traced=node_env is not None,
        graph_cache=warm["graph_cache"],
        cold_startup_s=cold["startup_s"],
        warm_startup_s=warm["startup_s"],
        warm_compile_s=warm["compile_s"],
    )
    if node_env and os.environ.get("GPU_REPORT"):
        import shutil

        shutil.make_archive(str(trace), "gztar", trace)  # what dynamo and inductor did, for a recompile's cause
    assert cold["compile_cache"] == "none" and cold["graph_cache"]["inductor_miss"] > 0
    # inductor compiled nothing: every graph's code came from the volume
    assert warm["compile_cache"].startswith("warm (") and warm["graph_cache"]["inductor_miss"] == 0, warm["graph_cache"]
    assert warm["graph_cache"]["inductor_hit"] + warm["graph_cache"]["aot_autograd_hit"] > 0
    # and AOTAutograd traced nothing again: torch bypasses its cache only for the subgraphs of a
    # DDP graph split at buckets, which seed.yaml's does on several GPUs and no config on one
    if NPROC == 1 or "seed" not in config:
        assert warm["graph_cache"]["aot_autograd_bypass"] == 0, warm["graph_cache"]


def test_streamed_shards_decode_on_the_gpu_like_the_cpu(tmp_path):
    """The streamed path's GPU decode (nvjpeg, one call per batch) reads the same images, labels
    and crops as the CPU workers' decode."""
    from conftest import make_jpegs

    from trainer.config_loader import load_config
    from trainer.worker.data.loader import Augment
    from trainer.worker.data.shards import write
    from trainer.worker.data.stream import Streamed, StreamLoader
    from trainer.worker.runtime import setup, teardown

    make_jpegs(tmp_path / "img", train=30, test=10, size=48)
    write(tmp_path / "img", tmp_path / "sh")
    out = {}
    for decode in ("gpu", "cpu"):
        cfg = load_config(
            None,
            [
                "data.name=shards",
                f"data.dir={tmp_path / 'sh'}",
                "data.image_size=96",
                f"data.decode={decode}",
                "train.batch_size=50",
                "data.stream_workers=1",
                "train.strategy=single",
                f"checkpoint.dir={tmp_path / 'ck'}",
            ],
        )
        rt = setup(cfg)
        try:
            loader = StreamLoader(
                Streamed(tmp_path / "sh", "train"), cfg, rt, 50, Augment(cfg, rt, False, 50, 6), decode == "gpu"
            )
            out[decode] = [(x.float().cpu(), y.cpu(), i.cpu()) for x, y, i in loader.epoch(0)]
        finally:
            teardown()
    assert len(out["gpu"]) == len(out["cpu"]) == 6
    for (xg, yg, ig), (xc, yc, ic) in zip(out["gpu"], out["cpu"], strict=True):
        assert torch.equal(yg, yc) and torch.equal(ig, ic) and xg.shape == xc.shape == (50, 3, 96, 96)
        assert (
            xg - xc
        ).abs().mean() < 0.1  # normalised units: JPEG decoders differ by a few levels, the rounding to uint8 on the CPU


def test_a_pretrained_start_trains_compiled_and_predict_on_the_gpu_agrees_with_the_cpu(tmp_path):
    """model.weights on CUDA (the file loaded into a model already on the GPU, channels-last,
    compiled, the freeze on a fused optimizer); then trainer predict on the GPU (nvjpeg, bf16,
    channels-last) against the same command on the CPU (PIL in the workers, fp32)."""
    from conftest import make_jpegs, run

    from trainer.worker import models

    make_jpegs(tmp_path / "img", train=30, test=10, size=48)
    torch.manual_seed(0)
    torch.save(models.build("resnet18", 10).state_dict(), tmp_path / "start.pth")
    ck = tmp_path / "ck"
    p = run(
        [
            sys.executable,
            "-m",
            "trainer",
            "train",
            "data.name=imagefolder",
            f"data.dir={tmp_path / 'img'}",
            "train.batch_size=50",
            "train.epochs=3",
            f"model.weights={tmp_path / 'start.pth'}",
            "model.freeze_epochs=1",
            "model.compile=true",
            "train.plot=false",
            f"checkpoint.dir={ck}",
        ],
        env=gpu_env(CUDA_VISIBLE_DEVICES="0"),
        timeout=600,
    )
    assert f"weights {tmp_path / 'start.pth'}" in p.stdout and "done: step 18" in p.stdout, p.stdout[-2000:]
    out = {}
    for where, e in (("gpu", gpu_env(CUDA_VISIBLE_DEVICES="0")), ("cpu", gpu_env(CUDA_VISIBLE_DEVICES=""))):
        q = run(
            [
                sys.executable,
                "-m",
                "trainer",
                "predict",
                str(ck),
                str(tmp_path / "img" / "test"),
                "--out",
                str(tmp_path / f"{where}.jsonl"),
                "-q",
            ],
            env=e,
            timeout=300,
        )
        assert "100 image(s) predicted" in q.stderr, q.stderr
        out[where] = [json.loads(line) for line in (tmp_path / f"{where}.jsonl").read_text().splitlines()]
    same = sum(g["top"][0]["class"] == c["top"][0]["class"] for g, c in zip(out["gpu"], out["cpu"], strict=True))
    gap = max(abs(g["top"][0]["prob"] - c["top"][0]["prob"]) for g, c in zip(out["gpu"], out["cpu"], strict=True))
    report(
        "pretrained start compiled on the GPU; predict GPU vs CPU", agree=same, of=100, largest_prob_gap=round(gap, 4)
    )
    # bf16 against fp32 and two JPEG decoders: a near tie may flip, nothing more
    assert same >= 95 and gap < 0.1, (same, gap)
