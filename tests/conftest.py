"""Shared helpers: real processes (python -m trainer, real torchrun), tiny synthetic data, never a
download. Every multi-process test runs on the CPU with gloo."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
TEST_DATA_ENV = "TRAINER_TEST_DATA"
"""A CIFAR-10 copy (train/ and test/ class folders of JPEGs, or their .tar.gz) for the tests that
read real images (.ci/run sets it); without it they read JPEGs the tests make (:func:`jpegs`)."""


def make_jpegs(root: Path, train: int = 260, test: int = 60, size: int = 32) -> Path:
    """CIFAR-10's layout with images made here: 10 classes, each a colour and a stripe direction
    under noise, JPEG-encoded (a model learns them well above chance, as it does CIFAR-10)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", train), ("test", test)):
        for c in range(10):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = torch.tensor([(c * 37) % 256, (c * 91) % 256, (c * 53 + 80) % 256], dtype=torch.float32).view(
                3, 1, 1
            )
            stripes = (torch.arange(size) // 4 % 2).float() * 60
            stripes = stripes.view(1, 1, size) if c % 2 else stripes.view(1, size, 1)
            for i in range(n):
                img = (colour + stripes + torch.randn(3, size, size, generator=gen) * 40).clamp(0, 255).to(torch.uint8)
                Image.fromarray(img.permute(1, 2, 0).numpy()).save(folder / f"{i}.jpg", quality=90)
    return root


@pytest.fixture(scope="session")
def jpegs(tmp_path_factory) -> Path:
    """CIFAR-10 as JPEGs: $TRAINER_TEST_DATA where set (CI: the real data set), else made here."""
    given = os.environ.get(TEST_DATA_ENV)
    if given:
        assert Path(given).is_dir(), (
            f"{TEST_DATA_ENV}={given} is no folder: point it at train/ and test/ class folders (or their .tar.gz)"
        )
        return Path(given)
    return make_jpegs(tmp_path_factory.mktemp("jpegs"))


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A folder ``make(folder)`` fills once for the whole run: under pytest-xdist the first worker
    that asks makes it (the others wait on a lock and reuse it), as a module fixture would be made
    again on every worker that runs one of the module's tests."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    root = tmp_path_factory.getbasetemp().parent / f"shared-{run_id}" if run_id else tmp_path_factory.getbasetemp()
    folder = root / name
    root.mkdir(exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not (root / f"{name}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed to make it left
            folder.mkdir()
            make(folder)
            (root / f"{name}.done").touch()
    return folder


ONE_WORKER = ("tests/test_slurm.py",)
"""Test files whose tests run on one worker, in order, under ``--dist loadgroup``: those of
test_slurm.py share the machine's one-node cluster (a second job would queue behind the first)."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (make test-slow): each test to whichever worker is free, except that the
    tests of a file in ONE_WORKER go together (pytest-xdist's own ``xdist_group`` mark does not reach
    pytest 9's node ids). Most long tests wait on links, timeouts and Slurm: spread test by test, a
    file of long ones no longer holds one worker while the others are done."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByTest(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return file if file in ONE_WORKER else nodeid

    return ByTest(config, log)


# A seconds-long run: no batch norm (so data-parallel equals one process), synthetic data.
TINY = [
    "model.name=tinynet",
    "data.name=synthetic",
    "data.synthetic_train_size=512",
    "data.synthetic_test_size=200",
    "train.batch_size=32",
    "train.log_every=4",
    "optim.lr=0.05",
    "optim.weight_decay=0",
    "train.plot=false",
    "train.deterministic=true",
]

# two ranks under DDP, channels-last convs, 12 steps (the lr warm-up included); BF16_DDP: with bf16
# weights and fp32 masters
DDP_12_STEPS = ["train.strategy=ddp", "model.channels_last=true", "train.max_steps=12", "checkpoint.every_epochs=0"]
BF16_DDP = [*DDP_12_STEPS, "train.precision=bf16", "train.param_dtype=bf16"]


def slow_steps(seconds: float) -> dict[str, str]:
    """Steps of at least ``seconds`` on rank 0 (the others wait for it), as variables of a job: a
    tiny job that lasts long enough to be disturbed while it mostly sleeps (the long suite runs
    many jobs side by side on a small machine: CPU is what it runs short of)."""
    return {"TRAINER_FAULT": f"batch:slow={seconds}", "TRAINER_FAULT_RANK": "0"}


def spawn(cmd: list[str], environ: dict[str, str], new_session: bool = False) -> subprocess.Popen:
    """A job whose output (stdout and stderr, line by line) the test reads from ``.stdout``; in its
    own session where the test signals it as a terminal would."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=new_session,
    )


def env(**extra: str) -> dict[str, str]:
    e = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC", "TRAINER_"))
    }
    # As the supervisor (`trainer torchrun`) sets it: tests that start torchrun directly need it too.
    e.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
    )
    # the test interpreter's environment first on PATH (torchrun, trainer), as an activated venv has it
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e.update(extra)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd_server(tmp_path):
    """A real etcd (Debian's etcd-server) with its v2 API on a free local port: the port."""
    import time

    import etcd

    port = free_port()
    server = subprocess.Popen(
        [
            "etcd",
            "--data-dir",
            str(tmp_path / "etcd"),
            "--enable-v2",
            f"--listen-client-urls=http://127.0.0.1:{port}",
            f"--advertise-client-urls=http://127.0.0.1:{port}",
            f"--listen-peer-urls=http://127.0.0.1:{free_port()}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 30
        while time.time() < deadline:  # serving: its v2 API answers
            try:
                etcd.Client(port=port).read("/")
                break
            except etcd.EtcdException:
                time.sleep(0.2)
        yield port
    finally:
        server.terminate()
        server.wait(10)


def trainer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]


def torchrun_cmd(nproc: int, *args: str, max_restarts: int = 0, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        *extra,
        "-m",
        "trainer",
        *args,
    ]


def run(cmd: list[str], timeout: float = 300, check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=kw.pop("env", env()), cwd=kw.pop("cwd", ROOT), **kw
    )
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-5000:]}"
        )
    return p


def train(ckpt: Path, *overrides: str, nproc: int = 1, **kw) -> subprocess.CompletedProcess:
    args = ("train", *TINY, f"checkpoint.dir={ckpt}", *overrides)
    return run(torchrun_cmd(nproc, *args) if nproc > 1 else trainer_cmd(*args), **kw)


def workers(agent: subprocess.Popen) -> dict[int, psutil.Process]:
    """The training processes under a launcher (torchrun, trainer launch), by rank."""
    out = {}
    for p in psutil.Process(agent.pid).children(recursive=True):
        try:
            rank = p.environ().get("RANK")
            if rank is not None and "trainer" in " ".join(p.cmdline()):
                out[int(rank)] = p
        except psutil.Error:
            continue
    return out


def worker(agent: subprocess.Popen, rank: int) -> psutil.Process:
    found = workers(agent)
    assert rank in found, f"no worker of rank {rank} under {agent.pid}: {sorted(found)}"
    return found[rank]


def newest(ckpt: Path) -> Path:
    steps = sorted((int(p.name.split("-")[1]), p) for p in ckpt.glob("step-*") if p.name.split("-")[1].isdigit())
    assert steps, f"no checkpoint in {ckpt}: {list(ckpt.iterdir()) if ckpt.exists() else 'missing'}"
    return steps[-1][1]


def saved(folder: Path) -> dict:
    """A checkpoint's whole state, by part, as the trainer reads it."""
    from trainer.worker.checkpoint import store

    return store.read(folder)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return saved(folder)["model"]


def write_format1(state: dict, root: Path, step: int) -> Path:
    """``state`` as versions before DCP wrote a checkpoint: one state.pt (the parts and the
    counters at the top level, the model's name, classes and config), and meta.json with its size,
    whole-file sha256 and part digests."""
    from trainer.files import sha256, sha256_parts

    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    torch.save({"format": 1, **state}, folder / "state.pt")
    f, part = folder / "state.pt", 1 << 26
    meta = {
        "format": 1,
        "step": step,
        "epoch": state.get("epoch"),
        "bytes": f.stat().st_size,
        "sha256": sha256(f),
        "parts": {"bytes": part, "sha256": sha256_parts(f, part)},
        "model": state.get("model_name"),
        "batch_size": (state.get("config") or {}).get("train", {}).get("batch_size"),
        "classes": state.get("classes"),
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def reseal(folder: Path) -> None:
    """meta.json's sizes and checksums made to match the files as they are now: a forger's step."""
    from trainer.files import sha256, sha256_parts

    meta = json.loads((folder / "meta.json").read_text())
    for name, f in meta.get("files", {}).items():
        f.update(bytes=(folder / name).stat().st_size, sha256=sha256_parts(folder / name, meta["part_bytes"]))
    if "files" not in meta:
        meta.update(bytes=(folder / "state.pt").stat().st_size, sha256=sha256(folder / "state.pt"), parts=None)
    (folder / "meta.json").write_text(json.dumps(meta))


def as_format1(folder: Path) -> dict:
    """A DCP checkpoint's state in the layout format 1 had (for write_format1)."""
    from trainer.worker.checkpoint import folder as files

    state, meta = saved(folder), files.read_meta(folder)
    return {
        "model_name": meta["model"],
        "classes": meta["classes"],
        "config": meta["config"],
        **state,
        **state.pop("train"),
    }


def tree_files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and mtime: 'nothing changed' checks. The run
    folder's lock file is left out: a run takes it (writing who holds it) before it reads any
    checkpoint, so a run that then stops on bad input has still rewritten it."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture
def warned(capsys):
    """Asserts that the code before said one warning line on stderr matching a pattern, and no
    Python warning (trainer.contract.warn: one line, no source line under it)."""

    def check(pattern: str) -> str:
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("warning: ")]
        assert any(re.search(pattern, line) for line in lines), err
        assert "Warning:" not in err and "warnings.warn" not in err, err
        return err

    return check


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


FAULT_RESULTS: list[tuple[str, int, int]] = []


def record_fault(case: str, trials: int, passed: int) -> None:
    FAULT_RESULTS.append((case, trials, passed))


GPU_FIGURES: list[dict] = []
"""The GPU suite's figures (tests/test_gpu.py's report()), each with the test that measured it."""
SHOWN = ("case", "date", "gpu", "gpus", "torch", "test")
"""A figure's fields the GPU table leaves out (the same for every row, or the row's own name)."""


def gpu_figure(row: dict) -> None:
    GPU_FIGURES.append({**row, "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]})


def gpu_table(outcomes: list[tuple[str, str]], figures: list[dict]) -> list[str]:
    """One line per GPU case: its name, its result, and what it measured (recovery s, ratio,
    accuracy), from the outcomes (test id, passed/failed/skipped) and the figures."""

    def shown(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    rows = []
    for test, outcome in outcomes:
        measured = "; ".join(
            ", ".join(f"{k} {shown(v)}" for k, v in f.items() if k not in SHOWN) for f in figures if f["test"] == test
        )
        rows.append((test.split("::")[-1].removeprefix("test_"), outcome, measured))
    width = max([len("case"), *(len(r[0]) for r in rows)])
    return [f"{'case'.ljust(width)}  result  figures", *(f"{c.ljust(width)}  {o:<6}  {m}" for c, o, m in rows)]


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its tables go to the controller
        session.config.workeroutput["fault_results"] = json.dumps(FAULT_RESULTS)
        session.config.workeroutput["gpu_figures"] = json.dumps(GPU_FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    FAULT_RESULTS.extend(tuple(r) for r in json.loads(getattr(node, "workeroutput", {}).get("fault_results", "[]")))
    GPU_FIGURES.extend(json.loads(getattr(node, "workeroutput", {}).get("gpu_figures", "[]")))


def pytest_terminal_summary(terminalreporter):
    outcomes = [
        (r.nodeid, kind)
        for kind in ("passed", "failed", "skipped")
        for r in terminalreporter.stats.get(kind, [])
        if getattr(r, "when", "call") in ("call", "setup") and "gpu" in getattr(r, "keywords", {})
    ]
    if outcomes:  # `make test-gpu`: one table at the end
        terminalreporter.section("GPU suite")
        for line in gpu_table(sorted(set(outcomes)), GPU_FIGURES):
            terminalreporter.write_line(line)
    if not FAULT_RESULTS:
        return
    table: dict[str, list[int]] = {}  # a case's trials, from whichever worker ran them
    for case, n, ok in FAULT_RESULTS:
        row = table.setdefault(case, [0, 0])
        row[0], row[1] = row[0] + n, row[1] + ok
    width = max(len(c) for c in table)
    terminalreporter.section("fault injection")
    terminalreporter.write_line(f"{'case'.ljust(width)}  trials  passed")
    for case, (n, ok) in table.items():
        terminalreporter.write_line(f"{case.ljust(width)}  {n:>6}  {ok:>6}")
    total, passed = sum(n for _, n, _ in FAULT_RESULTS), sum(ok for _, _, ok in FAULT_RESULTS)
    terminalreporter.write_line(f"{'total'.ljust(width)}  {total:>6}  {passed:>6}")


def same_training(
    tmp_path: Path, args: list[str], option: str, extra_env: dict | None = None, nproc: int = 2, rtol: float = 1e-5
) -> None:
    """Train twice under real torchrun (tests/resume_probe.py), with ``option``=true and =false:
    every saved tensor (weights or fp32 masters, optimizer state) must end the same up to float
    rounding: ``rtol`` of its norm (1e-5 for fp32 arithmetic in another order; bf16 gradients
    rounded in another place need more). A wrong scale, layout or missed update is 1e-2 and more."""
    values = {}
    for mode in ("true", "false"):
        out = tmp_path / f"{mode}.pt"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "tests/resume_probe.py",
            str(out),
            *args,
            f"{option}={mode}",
            f"checkpoint.dir={tmp_path / mode}",
        ]
        run(cmd, env=env(MASTER_PORT=str(free_port()), **(extra_env or {})), timeout=600)
        values[mode] = torch.load(out, weights_only=False)["values"]
    on, off = values["true"], values["false"]
    assert on.keys() == off.keys() and on
    for k, a in off.items():
        b = on[k]
        assert a.dtype == b.dtype, k
        assert (a.double() - b.double()).norm() <= rtol * a.double().norm(), (
            f"{k}: {(a.double() - b.double()).norm() / a.double().norm():.2e} of its norm apart"
        )


@pytest.fixture(scope="session")
def small_run(tmp_path_factory) -> tuple[Path, Path]:
    """(a run folder of tinynet trained a few steps on JPEGs made here, those JPEGs): what
    trainer predict and trainer export read, made once per test run."""

    def make(folder: Path) -> None:
        make_jpegs(folder / "images", train=40, test=12)
        run(
            trainer_cmd(
                "train",
                *TINY,
                "data.name=imagefolder",
                f"data.dir={folder / 'images'}",
                "train.batch_size=40",
                "train.epochs=3",
                f"checkpoint.dir={folder / 'run'}",
                "checkpoint.async_save=false",
            )
        )

    folder = made_once(tmp_path_factory, "small-run", make)
    return folder / "run", folder / "images"
