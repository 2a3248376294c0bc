"""The process's place in the job: strategy, rank, local rank, world size and device.

Everything comes from the environment that torchrun (or the Kubeflow operator, or Slurm through
torchrun) sets: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. The same
code runs as one process with no launcher at all (strategy cpu, single or dp), so there is one
code path from a laptop to many nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import Config, ConfigError, check_batch, check_devices, check_world_range
from trainer.contract import NNODES_ENV

DIST_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Runtime:
    strategy: str
    """Resolved strategy: cpu, single, dp, ddp or fsdp."""
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None
    """Collective backend when a process group exists, else None."""
    group: str = ""
    """An id every rank of this process group shares (rank 0's, gathered with the hosts): what this
    group writes to torchrun's store, which may outlive it, is kept apart from an earlier group's."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def collectives(self) -> bool:
        """Other ranks to agree with. A process group of one (a one-GPU `trainer launch`) skips
        the agreements, whose NCCL collectives would only move the process's own data."""
        return self.distributed and self.world_size > 1

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def per_rank_batch(self, global_batch: int) -> int:
        return global_batch // self.world_size


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in DIST_ENV)


def resolve(cfg: Config) -> Runtime:
    """Decide strategy, rank and device from the config and the environment (no side effects).

    Raises ConfigError for combinations that cannot work, naming the fix.
    """
    has_cuda = torch.cuda.is_available()
    check_devices(cfg, has_cuda)
    strategy = cfg.train.strategy
    in_group = launched_by_torchrun()
    if strategy == "auto":
        strategy = "ddp" if in_group else ("single" if has_cuda else "cpu")
    if strategy in ("cpu", "single", "dp"):
        if in_group and int(os.environ["WORLD_SIZE"]) > 1:
            raise ConfigError(
                f"train.strategy={strategy} runs one process but torchrun started {os.environ['WORLD_SIZE']}; "
                "use train.strategy=ddp (or auto) under torchrun"
            )
        if problem := cfg.combination_problem(strategy, has_cuda):
            raise ConfigError(problem)
        device = torch.device("cpu") if strategy == "cpu" else torch.device("cuda", 0)
        return Runtime(strategy, 0, 0, 1, device, None)

    # ddp / fsdp
    if not in_group:
        raise ConfigError(
            f"train.strategy={strategy} needs the environment torchrun sets; launch with "
            "`torchrun --nproc-per-node N -m trainer train ...` (or use train.strategy=auto)"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = has_cuda if cfg.train.device == "auto" else cfg.train.device == "cuda"
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible; "
                f"start at most {torch.cuda.device_count()} processes per node (--nproc-per-node)"
            )
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = ("nccl" if use_cuda else "gloo") if cfg.dist.backend == "auto" else cfg.dist.backend
    return Runtime(strategy, rank, local_rank, world, device, backend)


def setup(cfg: Config) -> Runtime:
    """Resolve, then bind the GPU and join the process group (with the collective timeout)."""
    rt = resolve(cfg)
    check_batch(cfg, rt.world_size)
    # an elastic job: every size it may take
    if ":" in (nnodes := os.environ.get(NNODES_ENV, "")) and "LOCAL_WORLD_SIZE" in os.environ:
        check_world_range(cfg, nnodes, int(os.environ["LOCAL_WORLD_SIZE"]))
    if rt.cuda:
        torch.cuda.set_device(rt.device)
    if rt.distributed and not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if rt.backend == "nccl":
            kwargs["device_id"] = rt.device  # eager init: NCCL communicators bind to this GPU now
            flight_recorder(cfg.checkpoint.root)
        dist.init_process_group(rt.backend, timeout=timedelta(seconds=cfg.dist.timeout_s), **kwargs)
    return rt


def flight_recorder(root: Path) -> None:
    """NCCL's flight recorder dumps into the run folder on a collective timeout (trainer/worker/
    watchdog.py: FLIGHT_RECORD), waiting at most 1 s for it: torch waits 60 s by default, a minute
    on top of dist.timeout_s before torchrun can restart the group."""
    from trainer.worker.watchdog import FLIGHT_RECORD

    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # rank 0's write probe says so in one line, next
        return
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):  # the name since torch 2.7, and before
        os.environ.setdefault(name, str(root / FLIGHT_RECORD))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "1000")


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(rt: Runtime) -> None:
    if rt.collectives:
        if rt.backend == "nccl":
            dist.barrier(device_ids=[rt.device.index])
        else:
            dist.barrier()


def broadcast(rt: Runtime, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (pickled through the store; small objects only)."""
    if not rt.collectives:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=rt.device if rt.backend == "nccl" else None)
    return box[0]


def all_reduce_sum(rt: Runtime, t: torch.Tensor) -> torch.Tensor:
    if rt.collectives:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_hosts(rt: Runtime) -> tuple[list[tuple[str, list[str]]], Runtime]:
    """Every rank's host name and addresses, in rank order (one small all-gather when the group
    forms): a worker that loses a peer later names it from the address in the error. With them
    the runtime whose ``group`` is rank 0's random id."""
    import secrets
    import socket

    from trainer.worker.crash import host_addresses

    mine = (socket.gethostname(), host_addresses(), secrets.token_hex(6))
    if rt.collectives:
        gathered: list = [None] * rt.world_size
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    return [(host, addrs) for host, addrs, _ in gathered], replace(rt, group=gathered[0][2])


def agree(rt: Runtime, error: BaseException | None) -> None:
    """Raise on every rank if any rank failed (the first rank's message), else return."""
    if not rt.collectives:
        if error is not None:
            raise error
        return
    gathered: list = [None] * rt.world_size
    dist.all_gather_object(gathered, None if error is None else str(error))
    first = next((m for m in gathered if m is not None), None)
    if first is not None:
        if error is not None and str(error) == first:
            raise error
        raise ConfigError(first)
