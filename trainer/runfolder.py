"""What the launcher and the workers both read, and nothing else: the run folder's ``step-N``
checkpoints (which are complete, the newest), its lock's name, and the files a worker keeps in the
supervisor's exit folder (its heartbeat ``hb-<rank>``, its last step ``step-<rank>``).

The standard library only: the launch side (trainer/launch/) imports this, never a worker module.
How a checkpoint is written, verified and loaded is the worker's (trainer/worker/checkpoint/).
"""

from __future__ import annotations

import re
from pathlib import Path

META = "meta.json"
"""Written last into a checkpoint's folder, before its rename: a ``step-N`` with it is complete."""
STEP_DIR = re.compile(r"^step-(\d+)$")
LOCK = ".lock"
"""The run folder's lock file (trainer/worker/checkpoint/lock.py): one job writes a run folder."""


def complete(root: Path) -> list[tuple[int, Path]]:
    """Checkpoints with a completion marker, oldest first (not yet verified)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / META).is_file()]
    return sorted(found)


def newest_complete(root: Path) -> Path | None:
    """The newest checkpoint with a completion marker, unverified: what ``resume=auto`` will try
    first (launchers check its model before starting workers)."""
    found = complete(root)
    return found[-1][1] if found else None


def heartbeat_file(folder: Path, rank: int) -> Path:
    """A worker's heartbeat in the exit folder: its watchdog rewrites it while the run progresses."""
    return folder / f"hb-{rank}"


def step_file(folder: Path, rank: int) -> Path:
    """8 bytes, the last step a worker finished (a shared mapping it writes at every step)."""
    return folder / f"step-{rank}"


def last_step(folder: Path, rank: int) -> int | None:
    """The last step a worker of ``rank`` finished, from its shared mapping (None if it has none)."""
    try:
        return int.from_bytes(step_file(folder, rank).read_bytes()[:8], "little", signed=True)
    except (OSError, ValueError):
        return None
