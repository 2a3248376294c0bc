"""The run folder's ``step-N`` checkpoints as files: which are complete, whether one is intact,
how a written one is committed, which are kept. No torch. What the launcher reads too (the complete
ones, the newest) is in trainer/runfolder.py.

A checkpoint is a folder. Its files are written into a hidden ``.tmp-step-N`` folder; then
``meta.json`` (the step, the model, the classes, the config, what is not a tensor, and each
file's size with one sha256 per 64 MiB part) is written and fsynced with the folder, and the
folder is renamed ``step-N``. The rename is the commit: a crash at any moment leaves either no
``step-N`` or a complete one, and a temporary folder is never taken for a checkpoint (it is removed
at the next start). On resume the newest ``step-N`` whose sizes and checksums match is used; a
damaged one is reported, renamed ``step-N.corrupt`` and skipped for the one before. A resume
picks by sizes and hashes the picked files while the model is built (checkpoint/checkpointer.py).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

from trainer.config import ConfigError
from trainer.files import sha256, sha256_parts
from trainer.runfolder import LOCK, META, STEP_DIR, complete, newest_complete  # noqa: F401 - the run folder's, here too
from trainer.worker.faults import crash_point

STATE = "state.pt"
"""The single file of checkpoints written before DCP (format 1); they still load."""
SET_ASIDE = re.compile(r"^step-\d+\.(corrupt\d*|replaced-\d+)$")
PART_BYTES = 1 << 26
"""The slice of a file that one sha256 in ``meta.json`` covers: a resume hashes the parts in threads."""
KEEP_SET_ASIDE = 2
"""Quarantined (``.corrupt``) and replaced (``.replaced-*``) folders kept for inspection; older
ones are deleted with a warning, so a crash loop cannot fill the volume with them."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (missing, not a checkpoint, damaged, or another model's)."""


def given(path: Path) -> Path:
    """The checkpoint a user names: a step-N folder as it is, a run folder's newest complete one
    (anything else as it is: its reader says what it is not)."""
    if path.is_dir() and not (path / META).is_file() and (newest := newest_complete(path)) is not None:
        return newest
    return path


def read_meta(folder: Path) -> dict:
    try:
        return json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder} is incomplete ({e.__class__.__name__})") from None


def files_of(meta: dict) -> dict[str, dict]:
    """Each file of the checkpoint with its size and sha256 (a list: one per part). A format-1
    checkpoint lists its one file at the top level, with a whole-file sha256 before the parts."""
    if "files" in meta:
        return meta["files"]
    parts = (meta.get("parts") or {}).get("sha256")
    return {STATE: {"bytes": meta.get("bytes"), "sha256": parts or meta.get("sha256")}}


def verify(folder: Path) -> dict:
    """meta.json of ``folder`` if every file has its recorded size and checksums; else raise."""
    meta = check_sizes(folder)
    check_sums(folder, meta)
    return meta


def check_sizes(folder: Path) -> dict:
    """meta.json of ``folder`` if every file is there with its recorded size (no byte read); else raise."""
    meta = read_meta(folder)
    for name, want in files_of(meta).items():
        try:
            size = (folder / name).stat().st_size
        except OSError as e:
            raise CheckpointError(f"checkpoint {folder} is incomplete ({name}: {e.strerror})") from None
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {folder} is truncated ({name}: {size} of {want['bytes']} bytes)")
    return meta


def check_sums(folder: Path, meta: dict) -> None:
    """Raise unless every file of ``folder`` has the checksums ``meta`` (its meta.json) records."""
    part_bytes = meta.get("part_bytes") or (meta.get("parts") or {}).get("bytes") or PART_BYTES
    for name, want in files_of(meta).items():
        digest = want["sha256"]
        got = sha256_parts(folder / name, part_bytes) if isinstance(digest, list) else sha256(folder / name)
        if got != digest:
            raise CheckpointError(f"checkpoint {folder} is corrupted ({name}: checksum mismatch)")


def quarantine(folder: Path) -> Path:
    target = folder.with_name(folder.name + ".corrupt")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.corrupt{n}")
    folder.rename(target)
    return target


def prune_set_aside(root: Path, keep: int = KEEP_SET_ASIDE, say=print) -> list[Path]:
    """Delete all but the newest ``keep`` quarantined or replaced folders (by modification time)."""
    aside = (
        sorted((p for p in root.iterdir() if SET_ASIDE.match(p.name) and p.is_dir()), key=lambda p: p.stat().st_mtime)
        if root.is_dir()
        else []
    )
    gone = aside[:-keep] if keep else aside
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    if gone:
        say(
            f"warning: deleted {len(gone)} set-aside checkpoint folder(s) ({', '.join(p.name for p in gone)}); the "
            f"newest {keep} are kept for inspection"
        )
    return gone


def newest_good(root: Path, say=print, sums: bool = True) -> Path | None:
    """The newest verified checkpoint in ``root`` (``sums=False``: its files only sized, the caller
    checks the sums); damaged ones are reported and set aside."""
    for _, folder in reversed(complete(root)):
        try:
            verify(folder) if sums else check_sizes(folder)
            return folder
        except CheckpointError as e:
            set_aside(root, folder, e, say)
    return None


def set_aside(root: Path, folder: Path, error: CheckpointError, say=print) -> None:
    """A damaged checkpoint renamed step-N.corrupt, with a line that says so."""
    moved = quarantine(folder)
    say(f"warning: {error}; skipped it (moved to {moved.name}) and trying the previous one")
    prune_set_aside(root, say=say)


def explicit_resume(root: Path, resume: str) -> Path | None:
    """The checks on checkpoint.resume that read no checkpoint: ``never`` refuses a folder that
    already holds checkpoints (nothing gets mixed or overwritten), a path must exist. Returns that
    path, or None for ``auto`` and ``never``."""
    if resume == "never":
        existing = complete(root)
        if existing:
            raise CheckpointError(
                f"checkpoint.dir={root} already holds checkpoints (newest {existing[-1][1].name}); use "
                f"checkpoint.resume=auto to continue them, or another checkpoint.dir"
            )
        return None
    if resume == "auto":
        return None
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint.resume={resume} does not exist; pass a step-N folder, or checkpoint.resume=auto"
        )
    return path


def check_model(saved: str | None, wanted: str, where: Path) -> None:
    if saved != wanted:
        raise CheckpointError(
            f"checkpoint {where} holds model {saved!r} but model.name={wanted}; set model.name={saved} or use another "
            f"checkpoint.dir"
        )


def check_classes(saved: list[str] | None, data: list[str] | None, where: Path) -> None:
    """A checkpoint's head has one output per class of the data it was trained on, in order."""
    if saved is None or data is None or list(saved) == list(data):
        return
    first = next(
        (f"{a!r} is {b!r} here" for a, b in zip(saved, data, strict=False) if a != b),
        f"{len(saved)} classes, {len(data)} here",
    )
    raise CheckpointError(
        f"checkpoint {where} was trained on other classes ({first}); point data.dir at the data it was trained on, "
        f"or start a new run in another checkpoint.dir"
    )


def check_global_batch(saved: int | None, wanted: int, where: Path) -> None:
    """A checkpoint counts in its own global batches (the step, the place in the epoch, the
    schedule's progress): resumed with another, the run would skip or repeat images of the epoch
    and take its learning rate past the schedule's end."""
    if saved is not None and saved != wanted:
        raise CheckpointError(
            f"checkpoint {where} was saved with train.batch_size={saved} but this run has train.batch_size={wanted}; "
            f"its step, place in the epoch and learning-rate schedule count batches of {saved}: resume with "
            f"train.batch_size={saved} (on any number of processes that divides it) or use another checkpoint.dir"
        )


def temporary(root: Path, step: int) -> Path:
    """Where step-N is written before its commit: one name that every rank of a sharded save agrees on."""
    return root / f".tmp-step-{step}"


def clean_temporaries(root: Path) -> None:
    for p in root.glob(".tmp-step-*"):
        shutil.rmtree(p, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, root: Path, step: int, keep: int, meta: dict, say=print) -> Path:
    """Publish the written folder ``tmp`` as ``root/step-N``: every file's size and part digests
    into meta.json (fsynced with the folder), the rename, then keep the newest ``keep``."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_parts(p, PART_BYTES)}
        for p in sorted(tmp.iterdir())
        if p.is_file()
    }
    with open(tmp / META, "w") as fh:
        json.dump({**meta, "step": step, "part_bytes": PART_BYTES, "files": files, "time": time.time()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync(tmp)
    crash_point("before-rename", step)
    final = root / f"step-{step}"
    replaced = final.exists()
    if replaced:  # a rewound run saving a step again: set the old one aside, never lose it
        final.rename(root / f"step-{step}.replaced-{time.time_ns()}")
    tmp.rename(final)
    _fsync(root)
    for _, old in complete(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    if replaced:
        prune_set_aside(root, say=say)
    return final


def os_error(e: BaseException | None) -> OSError | None:
    """The file-system error behind ``e``: torch wraps it in errors of its own (DCP gathers each
    rank's failure into a CheckpointException's ``failures``)."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError):
            return e
        inner = [f[0] if isinstance(f, tuple) else f for f in (getattr(e, "failures", None) or {}).values()]
        e, seen = (
            next((f for f in inner if isinstance(f, BaseException)), None) or e.__cause__ or e.__context__,
            seen + 1,
        )
    return None


def write_failed(root: Path, step: int, e: OSError, need_bytes: int) -> CheckpointError:
    try:
        free = f"{shutil.disk_usage(root).free / 1e9:.2f} GB free"
    except OSError:
        free = "free space unknown"
    newest = newest_complete(root)
    kept = f"the newest complete checkpoint is {newest.name}" if newest else "no complete checkpoint exists yet"
    return CheckpointError(
        f"could not write checkpoint step-{step} into {root}: {e.strerror or e} (it needs about "
        f"{need_bytes / 1e9:.2f} GB, "
        f"{free}); {kept}; free space or point checkpoint.dir at a larger volume, then run again to resume"
    )


def space_needed(root: Path, state_bytes: int, keep: int) -> int:
    """Free bytes a run needs on top of what its folder holds: a save writes the new checkpoint
    before it deletes the oldest, so keep-K peaks at K + 1 checkpoints."""
    have = min(len(complete(root)), keep)
    return max(1, keep + 1 - have) * state_bytes


def _owner_hint(root: Path, e: OSError) -> str:
    """For a permission error: whose folder it is, when that is not us. The usual cause is a bind
    mount that the container engine created, as root, because it did not exist yet."""
    if e.errno != errno.EACCES:
        return ""
    folder = next((p for p in (root, *root.parents) if p.exists()), None)
    if folder is None or folder.stat().st_uid == os.getuid():
        return ""
    return (
        f": {folder} belongs to uid {folder.stat().st_uid}, this process runs as uid {os.getuid()}; "
        f"create the folder as the user that runs the job before the container starts (mkdir -p), or run as its owner "
        f"(-u UID:GID)"
    )


def probe(root: Path, need_bytes: int, keep: int | None = None) -> None:
    """Fail now, not after an hour, when ``root`` is unwritable or has no room for the checkpoints
    the run will keep (``need_bytes`` is one checkpoint; ``keep`` K means K + 1 at a save)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        test = root / f".write-probe-{os.getpid()}"
        with open(test, "wb") as fh:
            fh.write(os.urandom(1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
        test.unlink()
    except OSError as e:
        raise CheckpointError(
            f"checkpoint.dir={root} is not writable ({e.strerror}{_owner_hint(root, e)}); mount it read-write or set "
            f"checkpoint.dir to a writable folder"
        ) from None
    free = shutil.disk_usage(root).free
    need = need_bytes if keep is None else space_needed(root, need_bytes, keep)
    if free < need * 1.1:
        what = (
            "one checkpoint needs"
            if keep is None
            else f"checkpoint.keep={keep} needs (K + 1 checkpoints at a save, {need_bytes / 1e9:.2f} GB each)"
        )
        raise CheckpointError(
            f"checkpoint.dir={root} has {free / 1e9:.2f} GB free but {what} about {need / 1e9:.2f} GB more; "
            f"free space, lower checkpoint.keep, or point checkpoint.dir at a larger volume"
        )
