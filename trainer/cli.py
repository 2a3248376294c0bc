"""``trainer``: train, eval, predict, export, config, check, data, launch, bench.

The one training command, the same under every launcher::

    python -m trainer train --config configs/smoke.yaml                  # one process: the CPU or one GPU
    torchrun --nproc-per-node 2 -m trainer train --config configs/default.yaml     # DDP on 2 GPUs (or CPU+gloo)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id JOB -m trainer train --config configs/default.yaml     # many nodes: no code change
    trainer launch --config configs/default.yaml    # checks the input, then torchrun, 1 process per GPU
    python -m torch.distributed.launch --nproc_per_node 2 -m trainer train ...   # legacy, --local-rank ok

Overrides follow the options as ``key=value`` (``train.epochs=5 data.dir=/data``). Usage errors
print one line and exit 2 before anything is written.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time

import click

from trainer.config import ConfigError, check_batch, check_devices, check_world_range
from trainer.config_args import config_arguments
from trainer.config_loader import explain, load_config, to_yaml
from trainer.contract import (
    EXIT_CRASH,
    EXIT_USAGE,
    die_with_parent,
    record_exit,
    stamp_command_start,
    stop_while_starting,
    supervised,
)
from trainer.launch.node import gpu_count, writable_home

_LOCAL_RANK = re.compile(r"^--local[-_]rank(=(\d+))?$")


def strip_local_rank(argv: list[str]) -> list[str]:
    """Accept torch.distributed.launch's ``--local_rank N`` / ``--local-rank=N`` anywhere in argv:
    drop it and export LOCAL_RANK (torchrun's environment wins when both are there)."""
    out, i = [], 0
    while i < len(argv):
        if m := _LOCAL_RANK.match(argv[i]):
            value = m.group(2)
            if value is None and i + 1 < len(argv):
                i += 1
                value = argv[i]
            os.environ.setdefault("LOCAL_RANK", str(value))
        else:
            out.append(argv[i])
        i += 1
    return out


def usage_errors(fn):
    """ConfigError -> one line on stderr (from rank 0 only) and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            if supervised():  # under `trainer torchrun`: the supervisor prints it once
                record_exit(EXIT_USAGE, f"error: {e}")
            elif os.environ.get("RANK", "0") == "0":
                click.echo(f"error: {e}", err=True)
            sys.exit(EXIT_USAGE)

    return wrapper


def config_options(fn):
    return usage_errors(config_arguments(fn))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """CIFAR-10 training for one CPU, one GPU, DataParallel, DDP and many nodes, from one command."""


@main.command()
@config_options
def train(config_file, overrides):
    """Train; resumes by itself from the newest complete checkpoint in checkpoint.dir.

    \b
    Any key of the config is set by KEY=VALUE after the options, e.g.:
      trainer train --config configs/smoke.yaml train.epochs=1 optim.lr=0.1
    Every key, with its type, default and meaning: trainer config --explain
    """
    started = time.perf_counter()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: die with torchrun, never train on orphaned
        die_with_parent()
    stop_while_starting()  # a stop before the run's own handler: exit 75 at once (nothing to save yet)
    cfg = load_config(config_file, overrides)  # bad input: one line, before torch's import
    from trainer.worker.main import train as train_worker

    sys.exit(train_worker(cfg, started))


@main.command("eval")
@click.argument("checkpoint_path", metavar="CHECKPOINT")
@click.option(
    "--report",
    "report_dir",
    metavar="DIR",
    help="Also write a report there: per-class figures (CSV), the confusion matrix "
    "(PNG), the most confused pairs and the worst-predicted images.",
)
@config_options
def eval_cmd(checkpoint_path, report_dir, config_file, overrides):
    """Test accuracy of a saved checkpoint (a step-N folder, or a run folder: its newest complete
    one). Overrides such as data.dir=... apply on top of the config stored in the checkpoint."""
    from trainer.worker.evaluate import evaluate_checkpoint

    used, loss, acc, n, report = evaluate_checkpoint(checkpoint_path, config_file, overrides, report_dir)
    if os.environ.get("RANK", "0") == "0":
        if report is not None:
            click.echo(report.table())
            click.echo(f"report in {report_dir}: per_class.csv, confused_pairs.csv, worst.csv, confusion.png")
        click.echo(f"{used}: test accuracy {100 * acc:.2f}% ({n} images), test loss {loss:.4f}")


@main.command()
@click.argument("source")
@click.argument("images", nargs=-1, required=True)
@click.option("--top-k", default=5, show_default=True, help="Classes shown per image.")
@click.option(
    "--out", metavar="FILE", help="Also write the predictions: JSON lines (.jsonl) or CSV (.csv), by the suffix."
)
@click.option("--batch-size", default=256, show_default=True, help="Images per batch.")
@click.option("--quiet", "-q", is_flag=True, help="No table; the summary line only (with --out).")
@usage_errors
def predict(source, images, top_k, out, batch_size, quiet):
    """The top-k classes of IMAGES (files, folders, a shards folder) by SOURCE: a step-N folder, a
    run folder (its newest complete checkpoint) or a file of trainer export. On the GPU where there
    is one. Unreadable files are named, skipped and counted."""
    from trainer.worker.predict import run

    done, skipped, model = run(source, list(images), top_k, out, batch_size, quiet)
    click.echo(
        f"{done} image(s) predicted by {model.source} ({model.name}, {len(model.classes)} classes)"
        + (f", {skipped} skipped (unreadable)" if skipped else "")
        + (f"; written to {out}" if out else ""),
        err=True,
    )


@main.command()
@click.argument("source")
@click.option(
    "--format", "fmt", type=click.Choice(["onnx", "pt2", "safetensors"]), required=True, help="What to write."
)
@click.option(
    "--out", metavar="FILE", help="The file to write (default: SOURCE's name with the format's suffix, here)."
)
@usage_errors
def export(source, fmt, out):
    """Write SOURCE (a step-N folder or a run folder) as one file to serve without this project:
    ONNX or .pt2 (a dynamic batch) or safetensors (+ JSON), with the classes, image size and
    normalisation inside; checked against PyTorch's logits after writing (a mismatch: exit 1)."""
    from trainer.worker.export import ExportMismatch
    from trainer.worker.export import export as write

    try:
        write(source, fmt, out, say=lambda line: click.echo(line, err=True))
    except ExportMismatch as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_CRASH)
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - the exporter could not take this model: one line, the traceback in a file
        import tempfile
        import traceback

        from trainer.contract import one_line

        with tempfile.NamedTemporaryFile("w", prefix=f"trainer-export-{fmt}-", suffix=".txt", delete=False) as fh:
            traceback.print_exc(file=fh)
        click.echo(
            f"error: the {fmt} export of {source} failed ({e.__class__.__name__}: {one_line(e, 160)}); the traceback "
            f"is in {fh.name}; "
            f"another --format may take this model",
            err=True,
        )
        sys.exit(EXIT_CRASH)


@main.command()
@click.option("--explain", "show_keys", is_flag=True, help="List every key with its type, default and meaning.")
@config_options
def config(show_keys, config_file, overrides):
    """Print the resolved config (defaults < --config file < key=value overrides)."""
    click.echo(explain() if show_keys else to_yaml(load_config(config_file, overrides)).rstrip("\n"))


@main.command()
@click.option(
    "--nnodes",
    default="1",
    show_default=True,
    help="Nodes the job runs on, N or MIN:MAX (elastic): every size must split the batch.",
)
@click.option("--nproc-per-node", default=1, show_default=True, help="Processes per node.")
@config_options
def check(nnodes, nproc_per_node, config_file, overrides):
    """Validate config and inputs without training (launchers run this before torchrun)."""
    cfg = load_config(config_file, overrides)  # usage errors before torch is imported
    check_world_range(cfg, nnodes, nproc_per_node)
    from trainer.worker.preflight import preflight

    preflight(cfg)
    click.echo("ok")


@main.command()
@click.option(
    "--shards", "shards_out", metavar="OUT", help="Write the image folder (data.dir) as shards in OUT, to stream from."
)
@click.option(
    "--max-side",
    default=512,
    show_default=True,
    help="With --shards: scale larger images down to this shorter side (0: keep).",
)
@config_options
def data(shards_out, max_side, config_file, overrides):
    """Download or decode the data set into its uint8 cache, then exit (e.g. an init container); or,
    with --shards OUT, write an image folder (or its .tar.gz) as shards once, to train from with
    data.name=shards data.dir=OUT."""
    cfg = load_config(config_file, overrides)  # usage errors before torch is imported
    from pathlib import Path

    from trainer.worker import data as datasets

    if shards_out:
        if cfg.data.name != "imagefolder":
            raise ConfigError(
                f"--shards reads an image folder; add data.name=imagefolder data.dir=IMAGES (data.name is "
                f"{cfg.data.name})"
            )
        from trainer.worker.data import shards

        index = shards.write(Path(cfg.data.dir), Path(shards_out), max_side)
        click.echo(
            f"{index['train']['images']} train and {index['test']['images']} test images, "
            f"{len(index['train']['classes'])} classes "
            f"in {shards_out}; train with: data.name=shards data.dir={shards_out}"
        )
        return
    plan = datasets.plan(cfg, None, 1)
    cfg.data.image_size = plan.image_size  # resolved: the cache holds the size that training reads
    if cfg.data.name == "shards":  # checked; the workers decode a set that fits, or stream it
        click.echo(f"{plan.source}: shards complete; {plan.path_why} (on this node)")
        return
    train_split, test_split = datasets.load(cfg)
    click.echo(f"{len(train_split)} train and {len(test_split)} test images, classes: {', '.join(train_split.classes)}")


@main.command()
def models():
    """The models model.name takes: this project's CIFAR networks, then torchvision's with the
    weights names model.weights takes."""
    from trainer.config import CIFAR_MODELS, torchvision_names

    click.echo("this project's (32 px; airnet and resnet18 any size): " + ", ".join(CIFAR_MODELS))
    click.echo(
        "torchvision's (any data.image_size they take; torchvision.resnet18 for its ResNet-18), each with its "
        "model.weights names:"
    )
    import torchvision.models as tvm

    for name in torchvision_names():
        click.echo(f"  {name}: " + ", ".join(tvm.get_model_weights(name).__members__))


@main.command(context_settings={"ignore_unknown_options": True})
@click.option(
    "--nproc-per-node",
    default="auto",
    envvar="NPROC_PER_NODE",
    show_envvar=True,
    help="Processes on this node (auto: one per visible GPU, else 2).",
)
@click.option(
    "--max-restarts",
    default=3,
    show_default=True,
    envvar="MAX_RESTARTS",
    show_envvar=True,
    help="torchrun restarts of the whole group after a failure.",
)
@config_options
def launch(nproc_per_node, max_restarts, config_file, overrides):
    """Check the config against this node and decode the data set into its cache if it is not
    there yet, then run torchrun -m trainer train with the same arguments, supervised (exit codes:
    see trainer/contract.py). Only this first decode imports torch here: on a restart the launcher
    costs a fraction of a second, and the workers make every other check (a bad input exits 2
    once, from rank 0, with no restart).

    ``--config auto`` (make run-local's default) picks a job that fits this machine, says which on
    the first line, and trains on the synthetic set where CIFAR-10 cannot be downloaded."""
    gpus = gpu_count()
    picked = config_file == "auto"
    overrides, why = list(overrides), ""
    if picked:
        config_file, why = pick_config(gpus)
    cfg = load_config(config_file, overrides)
    if nproc_per_node == "auto":
        nproc_per_node = str(gpus or 2)
    if not nproc_per_node.isdigit() or int(nproc_per_node) < 1:
        raise ConfigError(f"--nproc-per-node={nproc_per_node} must be a positive number or auto")
    nproc = int(nproc_per_node)
    check_devices(cfg, gpus > 0)
    if picked:
        cfg = say_the_pick(cfg, config_file, overrides, nproc, why)
    check_batch(cfg, nproc)
    from trainer.worker.preflight import resume_from

    resume_from(cfg)  # a resume path that is wrong: its line now, before a download or a decode
    prepare_data(cfg, config_file, overrides, nproc, picked)
    # torchrun sets one thread per process and prints four lines about it; share the cores instead
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))
    args = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "-m", "trainer", "train"]
    args += (["--config", config_file] if config_file else []) + overrides
    click.echo("torchrun " + " ".join(args), err=True)
    sys.exit(_supervised(args))


def say_the_pick(cfg, config_file: str, overrides: list[str], nproc: int, why: str):
    """The first line of --config auto: the job picked, and with DATA= (your images) what was
    fitted to them (added to ``overrides``). The config as it now stands."""
    if cfg.data.name not in ("imagefolder", "shards"):
        click.echo(why, err=True)
        return cfg
    fitted, said = fit_to_images(cfg, overrides, nproc)
    click.echo(
        f"{why.split(':')[0]}: {config_file}, fitted to the images in {cfg.data.dir}: {said}; ARGS= sets any of them",
        err=True,
    )
    overrides += fitted
    return load_config(config_file, overrides)


def prepare_data(cfg, config_file: str, overrides: list[str], nproc: int, picked: bool) -> None:
    """The data set decoded once into the uint8 cache the workers then read (not for a streamed
    set). A picked job whose CIFAR-10 cannot be downloaded trains on the synthetic set, and says
    so (``overrides`` gets data.name=synthetic); a named config gets its data or its error."""
    from trainer.worker import data as datasets

    plan = datasets.plan(cfg, None, nproc)
    cfg.data.image_size = plan.image_size  # resolved, as the workers will
    if plan.stream or datasets.ready(cfg):
        return
    try:
        datasets.load(cfg)
    except datasets.NotDownloaded as e:
        if not picked:
            raise
        overrides.append("data.name=synthetic")
        click.echo(
            f"CIFAR-10 could not be downloaded ({e.reason}): training on the synthetic set instead (generated images: "
            "its accuracy says nothing of CIFAR-10). With a copy of CIFAR-10 here: make run-local "
            "DATA=/path/to/cifar10",
            err=True,
        )
        datasets.load(load_config(config_file, overrides))


def pick_config(gpus: int) -> tuple[str, str]:
    """The job make run-local runs where no CONFIG is given, and its first line."""
    if gpus:
        return "configs/default.yaml", (
            f"{gpus} GPU(s) here: configs/default.yaml, the default recipe (ResNet-18, 30 epochs of CIFAR-10); "
            "CONFIG=FILE runs another"
        )
    return "configs/cpu.yaml", (
        "no GPU here: configs/cpu.yaml, a small network for 4 epochs of CIFAR-10 (about a minute on 2 cores; the "
        "default recipe is a GPU job); CONFIG=FILE runs another"
    )


def fit_to_images(cfg, overrides: list[str], nproc: int) -> tuple[list[str], str]:
    """make run-local DATA=<your images> with no CONFIG: the picked job made to fit the images, where
    the user has not set the key: a model that takes their size, a batch the set fills four times,
    a run folder of their own (not the CIFAR run's). (The overrides that do it, what they are.)"""
    from pathlib import Path

    from trainer.worker import data as datasets
    from trainer.worker import models

    given = {o.split("=", 1)[0] for o in overrides if "=" in o}
    size, _ = datasets.resolve_image_size(cfg)
    changes, said = [], []
    if "model.name" not in given and models.input_problem(cfg.model.name, size):
        changes.append("model.name=torchvision.resnet18")
        said.append(f"model torchvision.resnet18 ({cfg.model.name} cannot take {size} px images)")
    n_train = datasets.train_images(cfg)
    if "train.batch_size" not in given and n_train and cfg.train.batch_size * 4 > n_train:
        batch = max(nproc, 1 << max(0, (n_train // 4).bit_length() - 1))
        batch -= batch % nproc
        changes.append(f"train.batch_size={batch}")
        said.append(f"batch {batch} ({n_train} training images)")
    if "checkpoint.dir" not in given:
        run = cfg.checkpoint.root.parent / Path(cfg.data.dir).resolve().name
        changes.append(f"checkpoint.dir={run}")
        said.append(f"run folder {run}")
    return changes, ", ".join(said)


def _supervised(torchrun_args: list[str]) -> int:
    from trainer.launch.supervisor import supervise

    sys.stdout.flush()
    return supervise(torchrun_args)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.pass_context
def torchrun(ctx):
    """torchrun ARGS (of this interpreter, venv or not), keeping the exit status contract: 0
    finished, 75 stopped after saving (resume me), 2 bad input (do not retry), else a crash.
    Every launcher (Kubernetes, Slurm, TorchX, the image) starts training through this."""
    sys.exit(_supervised(list(ctx.args)))


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
@usage_errors
def bench(ctx):
    """GPU benchmarks (BENCHMARKS.md): the article's loop beside this trainer. They live in the
    repository's bench/, outside the installed package: run this from a clone."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / "bench" / "run.py").is_file():
        raise ConfigError(
            f"trainer bench runs the benchmarks of a clone of the repository (bench/), which this install at {root} "
            "does not have; clone it and run `pip install -e .` there, then trainer bench again"
        )
    sys.path.insert(0, str(root))
    from bench import run

    sys.exit(run.main(ctx.args))


def entry() -> None:
    stamp_command_start()  # `trainer ...` (python -m trainer stamps it earlier)
    writable_home()
    main(args=strip_local_rank(sys.argv[1:]), prog_name="trainer")


if __name__ == "__main__":
    entry()
