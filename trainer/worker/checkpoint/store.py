"""A checkpoint's bytes, through torch.distributed.checkpoint (DCP).

Tensors go through DCP. Each process writes what only it holds: under fsdp its shard, in parallel;
otherwise rank 0 writes everything alone, as before, since the other ranks hold copies. A load
reads into the live tensors (their dtype, device and memory format stay) and reshards to this
run's strategy and world size.

What is not a tensor (the counters, the schedule, the optimizer's settings) goes into meta.json as
JSON, beside the config, the model's name and the classes: readable without torch.

Untrusted input. A checkpoint may come from elsewhere (``trainer eval`` of a downloaded one).
DCP's ``.metadata`` is a pickle and its non-tensor entries are loaded with ``weights_only=False``.
:class:`SafeReader` unpickles the metadata with an unpickler that knows only DCP's metadata
classes, and refuses any entry that is not a tensor; this writer never makes one.

Checkpoints of format 1 (one ``state.pt``, written before DCP) still load, through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from trainer.contract import one_line
from trainer.worker.checkpoint import folder as files
from trainer.worker.checkpoint.folder import STATE, CheckpointError

FORMAT = 2
"""meta.json's ``format``: 2 is DCP; 1 is one state.pt."""


# --------------------------------------------------------------------------------------------
# Tensors to DCP, the rest to JSON.


def split(state: dict) -> tuple[dict, dict]:
    """(tensors, rest) of a nested dict, in the same nesting."""
    tensors, rest = {}, {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v.detach()  # a plain tensor: no Python attributes for a stager to copy
        elif isinstance(v, dict):
            tensors[k], rest[k] = split(v)
        else:
            rest[k] = v
    return tensors, rest


def merge(tensors: dict, rest: dict) -> dict:
    out = dict(rest)
    for k, v in tensors.items():
        out[k] = merge(v, out.get(k) or {}) if isinstance(v, dict) else v
    return out


def flat(tensors: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors by DCP's key: the nested keys joined with dots."""
    out = {}
    for k, v in tensors.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _only(tensors: dict, keep: set[str], prefix: str = "") -> dict:
    """``tensors`` without the keys the checkpoint lacks."""
    out = {}
    for k, v in tensors.items():
        if isinstance(v, dict):
            out[k] = _only(v, keep, f"{prefix}{k}.")
        elif f"{prefix}{k}" in keep:
            out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# Reading DCP's metadata as untrusted input.


class _MetadataUnpickler(pickle.Unpickler):
    SAFE = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("collections", "OrderedDict"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):  # how newer Pythons pickle an enum member: by its name
            return _member
        if (
            (module, name) in self.SAFE
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def _member(cls: Any, name: str) -> Any:
    """getattr for one thing only, a member of one of DCP's metadata enums (any other attribute
    would open every class to the pickle)."""
    import enum

    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and cls.__module__ == "torch.distributed.checkpoint.metadata"
        and name in cls.__members__
    ):
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not part of a checkpoint's metadata")


def _reader(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

    class SafeReader(FileSystemReader):
        md = None  # read once: a load asks for it again

        def read_metadata(self, *args: Any, **kwargs: Any):
            if self.md is None:
                try:
                    with open(folder / ".metadata", "rb") as fh:
                        md = _MetadataUnpickler(fh).load()
                except Exception as e:  # noqa: BLE001 - every way a file fails to be metadata means the same here
                    raise CheckpointError(
                        f"{folder} is not a loadable trainer checkpoint ({one_line(e, 160)}); "
                        f"pass a step-N folder written by `trainer train`"
                    ) from None
                odd = [k for k, v in md.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
                if odd:
                    raise CheckpointError(
                        f"{folder} holds entries that are not tensors ({odd[0]}); a trainer checkpoint has none: "
                        f"pass a step-N folder written by `trainer train`"
                    )
                md.storage_meta = md.storage_meta or StorageMeta()
                self.md = md
            self.md.storage_meta.load_id = self.load_id
            return self.md

    return SafeReader(folder)


# --------------------------------------------------------------------------------------------
# Writing and reading.


def write(
    tensors: dict, root: Path, step: int, keep: int, meta: dict, *, writer: bool = True, group=None, say=print
) -> Path | None:
    """Write ``tensors`` through DCP into ``.tmp-step-N``; then the writer (rank 0) commits it as
    ``step-N`` with ``meta`` (what is not a tensor, as JSON). With ``group`` every rank of it
    writes its own tensors (fsdp's shards) and must call; without, this process writes all."""
    import torch.distributed.checkpoint as dcp

    tmp = files.temporary(root, step)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), process_group=group, no_dist=group is None)
        return files.commit(tmp, root, step, keep, {"format": FORMAT, **meta}, say=say) if writer else None
    except BaseException as e:
        failure = files.os_error(e)
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:  # a full, read-only or vanished volume: say so, do not crash-loop
            raise files.write_failed(
                root, step, failure, sum(t.numel() * t.element_size() for t in flat(tensors).values())
            ) from None
        raise


def write_state(state: dict, root: Path, step: int, keep: int, about: dict | None = None) -> Path:
    """A whole state, by part as :func:`read` gives it, as ``root/step-N`` from this process alone."""
    tensors, rest = split(state)
    return write(tensors, root, step, keep, {**(about or {}), "state": rest})


def legacy(folder: Path) -> dict | None:
    """The whole state of a format-1 checkpoint (one state.pt), or None for a DCP one."""
    if not (folder / STATE).is_file():
        return None
    try:
        state = torch.load(folder / STATE, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - pickle, zip and type errors all mean the same to the user
        raise CheckpointError(
            f"{folder / STATE} is not a loadable trainer checkpoint ({e.__class__.__name__}: {one_line(e, 160)}); "
            f"pass a step-N folder written by `trainer train`"
        ) from None
    if not isinstance(state, dict) or state.get("format") != 1 or "model" not in state:
        raise CheckpointError(
            f"{folder / STATE} is not a trainer checkpoint (no format/model entries); pass a step-N folder written by "
            f"`trainer train`"
        )
    state["train"] = {k: state.get(k, 0) for k in ("epoch", "epoch_step", "step")}
    return state


def open_checkpoint(path: Path, verify: bool) -> tuple[Path, dict, dict | None]:
    """(folder, what the checkpoint says of itself, the whole state if it is of format 1) for a
    step-N folder or a file in it; its sizes and checksums are checked first if ``verify``.
    What it says: model, classes, batch size, config and the state that is not tensors."""
    folder = path if path.is_dir() else path.parent
    if not path.exists():
        raise CheckpointError(
            f"checkpoint {path} does not exist; pass a step-N folder from checkpoint.dir, or resume=auto"
        )
    if not (folder / files.META).is_file():
        raise CheckpointError(
            f"{path} is not a trainer checkpoint and holds none (no {files.META}); pass a step-N folder or the run "
            f"folder of `trainer train`"
        )
    meta = files.verify(folder) if verify else files.read_meta(folder)
    old = legacy(folder)
    if old is not None:
        meta = {
            "model": old.get("model_name"),
            "classes": old.get("classes"),
            "config": old.get("config"),
            "batch_size": (old.get("config") or {}).get("train", {}).get("batch_size"),
        }
    return folder, meta, old


def load_into(
    folder: Path, targets: dict[str, dict], about: dict, group=None, old: dict | None = None
) -> dict[str, dict]:
    """Each part's saved state, by part: its tensors read in place into ``targets`` (the live
    state dicts), merged with what meta.json holds (``about``, as open_checkpoint gave it). Every
    weight of the model must be there in its shape; other keys the checkpoint lacks are left out
    (a part's load decides). Under fsdp every rank calls with ``group``."""
    if old is not None:
        return {k: old[k] for k in targets if old.get(k) is not None}
    import torch.distributed.checkpoint as dcp

    reader = _reader(folder)  # reads .metadata once, here and for dcp.load
    have = reader.read_metadata().state_dict_metadata
    for key, t in flat(targets.get("model", {}), "model.").items():
        found = have.get(key)
        if found is None or tuple(found.size) != tuple(t.shape):
            what = "missing" if found is None else f"{tuple(found.size)} saved, {tuple(t.shape)} here"
            raise CheckpointError(
                f"checkpoint {folder} does not fit model {about.get('model')} ({key[6:]}: {what}); use a checkpoint "
                f"of this model"
            )
    rest = about.get("state", {})
    wanted = {k: _only(split(t)[0], set(have), f"{k}.") for k, t in targets.items() if k in rest}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, storage_reader=reader, process_group=group, no_dist=group is None)
    return {k: merge(wanted[k], rest[k]) for k in wanted}


def read(folder: Path, parts: tuple[str, ...] | None = None) -> dict:
    """The saved state as whole CPU tensors by part (``parts``: only these), with what is not a
    tensor: to look inside, or to use the weights elsewhere. Either format."""
    old = legacy(folder)
    if old is not None:
        return {k: v for k, v in old.items() if parts is None or k in parts}
    import torch.distributed.checkpoint as dcp

    reader = _reader(folder)  # reads .metadata once, here and for dcp.load
    md = reader.read_metadata()
    paths = md.planner_data  # DCP's key -> the nested path it came from
    tensors = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if parts is None or paths[k][0] in parts
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    nested: dict = {}
    for key, t in tensors.items():
        *outer, last = paths[key]
        at = nested
        for k in outer:
            at = at.setdefault(k, {})
        at[last] = t
    rest = files.read_meta(folder).get("state", {})
    return merge(nested, {k: v for k, v in rest.items() if parts is None or k in parts})
