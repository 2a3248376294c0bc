from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, env, reseal, write_format1

from trainer.config_loader import load_config
from trainer.worker.checkpoint import folder as checkpoint
from trainer.worker.checkpoint import parts, store
from trainer.worker.checkpoint.checkpointer import Checkpointer
from trainer.worker.checkpoint.folder import CheckpointError


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(64, 64)}, "train": {"step": step, "epoch": 0, "epoch_step": step}}


def write(s: dict, root, step: int, keep: int = 3):
    return store.write_state(s, root, step, keep, {"model": "tinynet"})


def test_write_is_complete_verified_and_keeps_the_last_k(tmp_path):
    for step in (10, 20, 30, 40):
        write(state(step), tmp_path, step, keep=2)
    assert [s for s, _ in checkpoint.complete(tmp_path)] == [30, 40]
    meta = checkpoint.verify(tmp_path / "step-40")
    assert meta["step"] == 40 and meta["format"] == store.FORMAT and meta["state"]["train"]["step"] == 40
    assert set(meta["files"]) == {".metadata", "__0_0.distcp"}
    assert all(meta["files"][n]["bytes"] == (tmp_path / "step-40" / n).stat().st_size for n in meta["files"])
    back = store.read(tmp_path / "step-40")
    assert torch.equal(back["model"]["w"], state(40)["model"]["w"]) and back["train"] == state(40)["train"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_damaged_part_is_found_and_format_1_checkpoints_verify_by_the_whole_file(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "PART_BYTES", 1000)
    write(state(1), tmp_path, 1)
    folder, f = tmp_path / "step-1", tmp_path / "step-1" / "__0_0.distcp"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["part_bytes"] == 1000 and len(meta["files"][f.name]["sha256"]) == -(-f.stat().st_size // 1000)
    checkpoint.verify(folder)
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF  # in the last, short part
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupted"):
        checkpoint.verify(folder)
    # a checkpoint of format 1 (one state.pt): its parts, or before them its whole-file sha256
    old = write_format1({"model": {"w": torch.ones(3)}, "model_name": "tinynet", "config": {}}, tmp_path / "old", 2)
    meta = checkpoint.verify(old)
    del meta["parts"]
    (old / "meta.json").write_text(json.dumps(meta))
    checkpoint.verify(old)
    (old / "state.pt").write_bytes((old / "state.pt").read_bytes()[:-1] + b"x")
    with pytest.raises(CheckpointError, match="corrupted"):
        checkpoint.verify(old)


def test_format_1_checkpoints_still_load(tmp_path):
    w = torch.randn(5, 5)
    old = write_format1(
        {
            "model": {"w": w},
            "model_name": "tinynet",
            "classes": ["a", "b"],
            "config": {"train": {"batch_size": 8}},
            "epoch": 1,
            "epoch_step": 2,
            "step": 9,
        },
        tmp_path,
        9,
    )
    folder, about, whole = store.open_checkpoint(old, verify=True)
    assert (about["model"], about["classes"], about["batch_size"]) == ("tinynet", ["a", "b"], 8)
    assert torch.equal(whole["model"]["w"], w) and whole["train"] == {"epoch": 1, "epoch_step": 2, "step": 9}
    assert torch.equal(store.read(old, ("model",))["model"]["w"], w)


def flip_a_byte(folder) -> None:
    f = folder / "__0_0.distcp"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-state"])
def test_damaged_newest_is_reported_set_aside_and_the_previous_used(tmp_path, damage):
    for step in (1, 2):
        write(state(step), tmp_path, step, keep=3)
    f = tmp_path / "step-2" / "__0_0.distcp"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "flip":
        flip_a_byte(tmp_path / "step-2")
    else:
        f.unlink()
    said = []
    assert checkpoint.newest_good(tmp_path, say=said.append) == tmp_path / "step-1"
    assert len(said) == 1 and "step-2" in said[0]
    assert (tmp_path / "step-2.corrupt").is_dir() and not (tmp_path / "step-2").exists()
    with pytest.raises(CheckpointError):
        checkpoint.verify(tmp_path / "step-2.corrupt")


@pytest.mark.parametrize("older", [True, False])
def test_a_resume_picks_by_size_and_confirms_the_checksums_hashed_meanwhile(tmp_path, older):
    """The pick reads no checkpoint's bytes (they are hashed on a thread while the model builds);
    the restore waits for the sums: a damaged pick is set aside for the previous one, or, with none
    left, the attempt stops as a crash (the model was built for a resume) and the next one starts
    from scratch."""
    from trainer.worker.checkpoint.checkpointer import CheckpointLost

    for step in (1, 2) if older else (2,):
        write(state(step), tmp_path, step)
    flip_a_byte(tmp_path / "step-2")
    said: list[str] = []
    ck = Checkpointer(
        load_config(None, ["model.name=tinynet", f"checkpoint.dir={tmp_path}"]), True, False, say=said.append
    )
    assert ck.claim_and_pick() == tmp_path / "step-2" and not said  # sized right: picked, not yet read
    if older:
        assert ck.confirm(tmp_path / "step-2") == tmp_path / "step-1"
    else:
        with pytest.raises(CheckpointLost, match="step-2 was damaged.*starts from scratch"):
            ck.confirm(tmp_path / "step-2")
    assert len(said) == 1 and "step-2" in said[0] and "checksum mismatch" in said[0], said
    assert (tmp_path / "step-2.corrupt").is_dir() and not (tmp_path / "step-2").exists()
    ck.lock.release()
    again = Checkpointer(load_config(None, ["model.name=tinynet", f"checkpoint.dir={tmp_path}"]), True, False)
    picked = again.claim_and_pick()
    assert picked == (tmp_path / "step-1" if older else None) and again.confirm(picked) == picked
    again.lock.release()


def test_keep_last_k_never_deletes_the_only_good_checkpoint(tmp_path):
    write(state(1), tmp_path, 1, keep=1)
    write(state(2), tmp_path, 2, keep=1)
    assert [p.name for _, p in checkpoint.complete(tmp_path)] == ["step-2"]
    # a rewound run writing a step again keeps the older copy aside instead of replacing it
    write(state(3), tmp_path, 2, keep=1)
    assert list(tmp_path.glob("step-2.replaced-*"))


def test_crash_between_write_and_rename_leaves_the_old_checkpoint(tmp_path):
    write(state(1), tmp_path, 1, keep=3)
    code = (
        "import sys, torch; from trainer.worker.checkpoint import store; from pathlib import Path\n"
        "store.write_state({'model': {'w': torch.ones(1000)}}, Path(sys.argv[1]), 2, 3)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env(TRAINER_FAULT="before-rename:kill"), cwd=ROOT
    )
    assert p.returncode == -signal.SIGKILL
    assert list(tmp_path.glob(".tmp-step-2")), "the half-done save is still there, under its temporary name"
    assert checkpoint.newest_good(tmp_path) == tmp_path / "step-1"
    checkpoint.clean_temporaries(tmp_path)
    assert not list(tmp_path.glob(".tmp-*"))


def test_files_that_are_not_checkpoints_are_refused(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(1000))
    with pytest.raises(CheckpointError, match="not a trainer checkpoint"):
        store.open_checkpoint(junk, verify=True)
    plain = tmp_path / "article" / "myModule_0.pth"  # what the article saved: a bare state_dict
    plain.parent.mkdir()
    torch.save({"0.weight": torch.ones(2)}, plain)
    with pytest.raises(CheckpointError, match="not a trainer checkpoint"):
        store.open_checkpoint(plain, verify=True)
    with pytest.raises(CheckpointError, match="does not exist"):
        store.open_checkpoint(tmp_path / "step-9", verify=True)
    folder = write(state(1), tmp_path / "ck", 1)
    (folder / ".metadata").write_bytes(os.urandom(1000))
    with pytest.raises(CheckpointError, match="not a loadable trainer checkpoint"):
        store.read(folder)


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("where", ["state.pt", ".metadata", "entry"])
def test_a_pickle_that_would_run_code_is_refused(tmp_path, where):
    """A forged checkpoint with matching checksums: code in a format-1 state.pt, in DCP's
    .metadata, or as a non-tensor entry (which DCP would load with weights_only=False)."""
    marker = tmp_path / "pwned"
    if where == "state.pt":
        folder = write_format1({"model": {}, "model_name": "tinynet", "config": {}}, tmp_path, 5)
        torch.save({"format": 1, "model": {}, "payload": Exploit(marker)}, folder / "state.pt", pickle_module=pickle)
    elif where == ".metadata":
        folder = write(state(5), tmp_path, 5)
        (folder / ".metadata").write_bytes(pickle.dumps(Exploit(marker)))
    else:
        import torch.distributed.checkpoint as dcp

        folder = write(state(5), tmp_path, 5)
        dcp.save({"model": {"w": Exploit(marker)}}, checkpoint_id=str(tmp_path / "evil"), no_dist=True)
        for name in (".metadata", "__0_0.distcp"):
            (folder / name).write_bytes((tmp_path / "evil" / name).read_bytes())
    reseal(folder)
    checkpoint.verify(folder)
    with pytest.raises(CheckpointError, match="not a loadable trainer checkpoint|not tensors"):
        store.open_checkpoint(folder, verify=True)[2] is not None or store.read(folder)
    assert not marker.exists()


def test_the_space_probe_counts_every_model_without_importing_the_compiler():
    # A run that does not compile (every CPU run) must not pay torch._dynamo's import for the
    # probe's shape count, and the count is the model's own: a plain meta build (which imports it)
    # gives the same parameter bytes.
    code = """
import json, sys, torch
from trainer.worker import models
from trainer.worker.checkpoint.parts import state_bytes
from trainer.config_loader import load_config
cfgs = [load_config(c, []) for c in ("configs/default.yaml", "configs/fast.yaml", "configs/seed.yaml")]
got = [state_bytes(cfg) for cfg in cfgs]
imported = "torch._dynamo" in sys.modules
plain = []
for cfg in cfgs:
    with torch.device("meta"):
        plain.append(sum(p.numel() * p.element_size() for p in models.build(cfg.model.name).parameters()))
print(json.dumps({"got": got, "imported": imported, "plain": plain, "after": "torch._dynamo" in sys.modules}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.splitlines()[-1])
    assert not r["imported"] and r["after"]  # the plain build does import it: the skip is what saves it
    # default: ResNet-18, SGD with momentum (2 copies); seed: bf16 weights beside fp32 masters, no momentum (1.5)
    assert r["got"][0] == 2 * r["plain"][0] and r["got"][2] == int(1.5 * r["plain"][2])
    assert r["got"][1] == 3 * r["plain"][1]  # fast: momentum and Lookahead


def test_write_probe_finds_unwritable_and_full_volumes(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="is not writable"):
        checkpoint.probe(blocker / "ck", 10)
    with pytest.raises(CheckpointError, match="GB free but one checkpoint needs"):
        checkpoint.probe(tmp_path / "ck", 10**18)
    checkpoint.probe(tmp_path / "ck", 10)
    assert list((tmp_path / "ck").iterdir()) == []


def test_an_async_save_writes_what_the_parts_held_at_the_call(tmp_path):
    """Training goes on while the write runs: the staged copy must not see it."""
    cfg = load_config(None, ["model.name=tinynet", f"checkpoint.dir={tmp_path}"])
    w = torch.randn(64, 64)

    class Part:
        def state_dict(self):
            return {"w": w}

    ck = Checkpointer(cfg, is_main=True, async_save=True)
    ck.register(model=Part(), train=parts.TrainState(step=7))
    ck.reserve()
    before = w.clone()
    stall, background = ck.save(7, sync=False)
    w.zero_()
    ck.wait()
    assert background and torch.equal(store.read(tmp_path / "step-7")["model"]["w"], before)
    assert store.read(tmp_path / "step-7")["train"]["step"] == 7


def test_keep_k_needs_room_for_k_plus_one_checkpoints(tmp_path):
    assert checkpoint.space_needed(tmp_path, 100, keep=3) == 400  # nothing there yet: K + 1 to come
    for step in (1, 2):
        write(state(step), tmp_path, step, keep=3)
    assert checkpoint.space_needed(tmp_path, 100, keep=3) == 200
    for step in (3, 4, 5):
        write(state(step), tmp_path, step, keep=3)
    assert checkpoint.space_needed(tmp_path, 100, keep=3) == 100  # steady state: one more at a save
    free = __import__("shutil").disk_usage(tmp_path).free
    with pytest.raises(
        CheckpointError, match=r"checkpoint.keep=2 needs \(K \+ 1 checkpoints at a save.*lower checkpoint.keep"
    ):
        checkpoint.probe(tmp_path / "new", free // 2, keep=2)
    checkpoint.probe(tmp_path / "new", free // 8, keep=2)


FULL_DISK = """
import resource, signal, sys, torch
from pathlib import Path
from trainer.worker.checkpoint import folder, store
root = Path(sys.argv[1])
store.write_state({"model": {"w": torch.ones(10)}}, root, 1, 3)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)           # a write past the limit fails with EFBIG,
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))  # as one past a full disk fails with ENOSPC
try:
    store.write_state({"model": {"w": torch.ones(100_000)}}, root, 2, 3)
except folder.CheckpointError as e:
    print(e)
"""


def test_a_failed_write_names_the_step_the_folder_the_space_and_the_newest_checkpoint(tmp_path):
    p = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env()
    )
    said = p.stdout.strip()
    assert said.startswith(f"could not write checkpoint step-2 into {tmp_path}: File too large"), p.stdout + p.stderr
    assert (
        "needs about 0.00 GB" in said
        and "GB free" in said
        and "newest complete checkpoint is step-1" in said
        and "run again to resume" in said
    )
    assert [s for s, _ in checkpoint.complete(tmp_path)] == [1] and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.slow
def test_a_full_volume_during_training_stops_with_exit_2_and_one_line(tmp_path):
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        # the 1 MB write probe fits, a ResNet-18 checkpoint (89 MB) does not
        resource.setrlimit(resource.RLIMIT_FSIZE, (5_000_000, 5_000_000))

    ck = tmp_path / "ck"
    from conftest import TINY, trainer_cmd

    p = subprocess.run(
        trainer_cmd(
            "train",
            *TINY,
            f"checkpoint.dir={ck}",
            "train.epochs=1",
            "checkpoint.every_steps=2",
            "optim.momentum=0.9",
            "model.name=resnet18",
        ),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env(),
        preexec_fn=limit,
        timeout=300,
    )
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-2000:]
    assert (
        "could not write checkpoint step-2" in errors[0]
        and "no complete checkpoint exists yet" in errors[0]
        and "Traceback" not in p.stderr
    )
    assert not list(ck.glob("step-*")) and not list(ck.glob(".tmp-*"))


def test_metadata_that_pickles_enum_members_by_name_loads_and_getattr_reaches_nothing_else(tmp_path):
    """Newer Pythons pickle an enum member as getattr(its class, its name), as the image's did; the
    reader takes that for DCP's own enums and nothing else (getattr on anything would reach every class)."""
    import enum
    import io

    folder = write(state(3), tmp_path, 3)

    class ByName(pickle.Pickler):
        def reducer_override(self, obj):
            return (getattr, (type(obj), obj.name)) if isinstance(obj, enum.Enum) else NotImplemented

    full = store._reader(folder).read_metadata()  # read as this Python wrote it
    md = set(full.state_dict_metadata)
    buf = io.BytesIO()
    ByName(buf).dump(full)
    assert b"getattr" in buf.getvalue()
    (folder / ".metadata").write_bytes(buf.getvalue())
    reseal(folder)
    assert set(store._reader(folder).read_metadata().state_dict_metadata) == md and torch.equal(
        store.read(folder)["model"]["w"], state(3)["model"]["w"]
    )
    # getattr(torch.Size, "__subclasses__")(): the first step to every class in the process
    (folder / ".metadata").write_bytes(b"cbuiltins\ngetattr\n(ctorch\nSize\nV__subclasses__\ntR(tR.")
    reseal(folder)
    with pytest.raises(CheckpointError, match="not a loadable trainer checkpoint.*__subclasses__"):
        store.read(folder)
