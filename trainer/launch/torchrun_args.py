"""torchrun's arguments as this job reads them: an option (spelt any of torchrun's ways, or from
the PET_ variables the Kubeflow operators set), --rdzv-conf, the config of its ``-m trainer
train``; the rendezvous settings a cluster job needs where not given (:func:`with_rdzv_defaults`);
and the one line for a rendezvous that could not form (:func:`rendezvous_failure`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainer.config import Config
from trainer.config_args import command_config
from trainer.contract import EXIT_CRASH, EXIT_DIR_ENV, RUN_DIR_ENV
from trainer.runfolder import newest_complete

ELASTIC_LAST_CALL_S = 5
"""An elastic group re-forms this long after its MIN nodes are back (torchrun's default: 30 s)."""
ETCD_LAST_CALL_S = 2
"""The same for etcd-v2 (torch's same rendezvous, its state in etcd), shorter: what it costs a lost
node, RELIABILITY.md, "A rendezvous in etcd"."""
ELASTIC_KEEP_ALIVE_S = 3
"""Seconds between an elastic job's rendezvous keep-alives (torchrun's default: 5 s)."""


def worker_config(torchrun_args: list[str]) -> Config | None:
    """The config of ``-m trainer train ...`` in torchrun's arguments, parsed once by the
    supervisor with the CLI's own grammar; None for another module, or bad input that the workers
    will report in their own words."""
    i = next((i for i in range(len(torchrun_args) - 2) if torchrun_args[i : i + 3] == ["-m", "trainer", "train"]), None)
    return None if i is None else command_config(torchrun_args[i + 3 :])


def option(argv: list[str], name: str, default: str = "") -> str:
    """A torchrun option's value, spelt --name=V, --name V, or with underscores; else, as torchrun
    reads it, from PET_NAME in the environment (what the Kubeflow operators set: PET_NNODES ...)."""
    names = {f"--{name}", f"--{name.replace('-', '_')}"}
    for i, a in enumerate(argv):
        key, eq, value = a.partition("=")
        if key in names:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else default)
    return os.environ.get("PET_" + name.upper().replace("-", "_"), default)


def endpoint(argv: list[str]) -> str:
    """--rdzv-endpoint, or torchrun's default."""
    return option(argv, "rdzv-endpoint") or "127.0.0.1:29400"


def rdzv_conf(argv: list[str]) -> dict[str, str]:
    """torchrun's --rdzv-conf K=V,K=V as a dict."""
    return dict(kv.split("=", 1) for kv in option(argv, "rdzv-conf").split(",") if "=" in kv)


def with_rdzv_defaults(argv: list[str]) -> list[str]:
    """torchrun's arguments with rendezvous settings that suit a cluster job, where not given:

    - read_timeout = join_timeout: c10d store reads that wait as long as the rendezvous does. With
      the default 60 s, a read that times out on a cut link leaves the agent's store connection out
      of step: when the link comes back, the agent fails and closes the rendezvous for every node,
      so a cut over a minute would end the job.
    - for an elastic range (--nnodes MIN:MAX): last_call_timeout = ELASTIC_LAST_CALL_S, so that once
      MIN nodes are back after a node is lost the group re-forms that much later instead of torchrun's
      30 s (a node that comes later joins at the next re-form); keep_alive_interval =
      ELASTIC_KEEP_ALIVE_S, so that a lost node is dropped from the rendezvous after 3 missed
      keep-alives, 9 s instead of 15 s (one small store write per node that often).
    - etcd-v2 (the same rendezvous, its state in etcd): the same for an elastic range, with
      last_call_timeout = ETCD_LAST_CALL_S."""
    backend = option(argv, "rdzv-backend")
    if backend not in ("c10d", "etcd-v2"):
        return argv
    conf = rdzv_conf(argv)
    wanted = {"read_timeout": conf.get("join_timeout", "600")} if backend == "c10d" else {}
    if ":" in option(argv, "nnodes", "1"):
        # etcd-v2: the same key, 30 s too
        wanted["last_call_timeout"] = str(ELASTIC_LAST_CALL_S if backend == "c10d" else ETCD_LAST_CALL_S)
        wanted["keep_alive_interval"] = str(ELASTIC_KEEP_ALIVE_S)
    if all(k in conf for k in wanted):
        return argv
    conf = {**conf, **{k: v for k, v in wanted.items() if k not in conf}}
    out, i = [], 0
    while i < len(argv):  # drop the given --rdzv-conf; the merged one goes first, among torchrun's options
        key, eq, _ = argv[i].partition("=")
        if key in ("--rdzv-conf", "--rdzv_conf"):
            i += 1 if eq else 2
            continue
        out.append(argv[i])
        i += 1
    return [f"--rdzv-conf={','.join(f'{k}={v}' for k, v in conf.items())}", *out]


def where_lost() -> str:
    """'at step N (the job resumes from step-M)' from what the workers said when they failed and
    the run folder, as far as they tell."""
    steps = []
    folder = os.environ.get(EXIT_DIR_ENV)
    for p in Path(folder).glob("[0-9]*-*") if folder else []:
        try:
            steps += [int(m) for m in re.findall(r" (?:at|after) step (\d+)", p.read_text())]
        except OSError:
            continue
    run_dir = os.environ.get(RUN_DIR_ENV)
    found = newest_complete(Path(run_dir)) if run_dir else None
    at = f"at step {max(steps)}" if steps else "during training"
    return f"{at} (the job resumes from {found.name})" if found else at


def rendezvous_failure(argv: list[str], error: BaseException, left: list[str] | None = None) -> str:
    """One line for a rendezvous that could not form: what happened, where, and the fix. ``left``:
    nodes of the last group that did not come back (trainer/launch/rendezvous.py saw them go)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

    at = endpoint(argv)
    nodes, job = option(argv, "nnodes", "1"), option(argv, "rdzv-id", "none")
    conf = rdzv_conf(argv)
    if isinstance(error, RendezvousTimeoutError) and left:
        return (
            f"torchrun: {', '.join(left)}, lost {where_lost()}, did not come back to the rendezvous at {at} "
            f"(id {job}) within {conf.get('join_timeout', '600')} s: start the same command there again, or run "
            f"elastic "
            f"(--nnodes MIN:{nodes.split(':')[-1]}) so that the nodes left go on; exit {EXIT_CRASH} so that the "
            f"scheduler retries "
            "from the newest checkpoint"
        )
    if isinstance(error, RendezvousTimeoutError):
        return (
            f"torchrun: the rendezvous at {at} (id {job}) did not gather {nodes} nodes within "
            f"{conf.get('join_timeout', '600')} s: start the same command on every node (same --rdzv-id, and "
            f"--rdzv-endpoint reachable from each), or wait longer with --rdzv-conf join_timeout=SECONDS"
        )
    if isinstance(error, RendezvousClosedError):
        return (
            f"torchrun: the rendezvous at {at} (id {job}) was closed: the job ended on another node; "
            "start every node again (with a new --rdzv-id if the old job's nodes are gone)"
        )
    return (
        f"torchrun: cannot reach the rendezvous at {at} (id {job}): {error or type(error).__name__}; check that "
        "the first node runs and that this node reaches it at that address and port"
    )
