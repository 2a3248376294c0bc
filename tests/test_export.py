"""trainer export (trainer/worker/export.py): each format is one file a user serves without this
project, checked against PyTorch's logits; trainer predict gives the same top-1 from each."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from conftest import TINY, env, run, trainer_cmd

FORMATS = ("onnx", "pt2", "safetensors")


def export(run_folder: Path, fmt: str, out: Path) -> subprocess.CompletedProcess:
    return run(trainer_cmd("export", str(run_folder), "--format", fmt, "--out", str(out)))


def predictions(source: Path, images: Path, tmp_path: Path) -> list[dict]:
    out = tmp_path / f"{source.name}.jsonl"
    run(trainer_cmd("predict", str(source), str(images / "test"), "--top-k", "3", "--out", str(out), "-q"))
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_every_export_predicts_what_the_checkpoint_predicts(small_run, tmp_path):
    run_folder, images = small_run
    want = predictions(run_folder, images, tmp_path)
    assert len(want) == 120
    for fmt in FORMATS:
        out = tmp_path / f"model.{fmt}"
        p = export(run_folder, fmt, out)
        line = p.stderr.strip().splitlines()[-1]
        assert (
            line.startswith(f"{out}: {fmt}, tinynet, 10 classes, 32 px")
            and "largest logit difference from PyTorch on 64 images of the test split" in line
        ), line
        got = predictions(out, images, tmp_path)
        assert [g["file"] for g in got] == [w["file"] for w in want]
        assert [g["top"][0]["class"] for g in got] == [w["top"][0]["class"] for w in want], fmt
        diff = max(
            abs(a["prob"] - b["prob"])
            for g, w in zip(got, want, strict=True)
            for a, b in zip(g["top"], w["top"], strict=True)
        )
        assert diff < 1e-4, f"{fmt}: probabilities {diff:.2e} apart"


def test_the_onnx_file_carries_what_a_server_needs_and_runs_in_onnxruntime(small_run, tmp_path):
    import numpy as np
    import onnxruntime as ort

    run_folder, _ = small_run
    export(run_folder, "onnx", tmp_path / "m.onnx")
    s = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    about = json.loads(s.get_modelmeta().custom_metadata_map["trainer"])
    assert (
        about["classes"] == [f"class{i}" for i in range(10)] and about["image_size"] == 32 and len(about["mean"]) == 3
    )
    for n in (1, 5):  # a dynamic batch
        out = s.run(None, {s.get_inputs()[0].name: np.zeros((n, 3, 32, 32), np.float32)})[0]
        assert out.shape == (n, 10)


def test_the_pt2_file_loads_in_a_venv_without_this_project(small_run, tmp_path):
    """A venv whose only packages are this one's site-packages (torch, not this project: the
    editable install's finder is a .pth file, which a path line does not run)."""
    run_folder, _ = small_run
    export(run_folder, "pt2", tmp_path / "m.pt2")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (purelib / "torch-only.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import json, torch\n"
        "try:\n    import trainer\n    raise SystemExit('this project is importable here')\nexcept ImportError:\n    "
        "pass\n"
        "extra = {'trainer.json': ''}\n"
        "m = torch.export.load('m.pt2', extra_files=extra).module()\n"
        "about = json.loads(extra['trainer.json'])\n"
        "print(tuple(m(torch.zeros(3, 3, about['image_size'], about['image_size'])).shape), len(about['classes']))\n"
    )
    p = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env(), timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "(3, 10) 10", p.stdout + p.stderr


@pytest.mark.slow
def test_safetensors_of_a_torchvision_model_load_into_torchvisions_own_model(tmp_path):
    import torchvision
    from safetensors.torch import load_file

    ck = tmp_path / "ck"
    run(
        trainer_cmd(
            "train",
            *TINY,
            "model.name=torchvision.resnet18",
            "train.max_steps=1",
            "train.deterministic=false",
            f"checkpoint.dir={ck}",
        )
    )
    export(ck, "safetensors", tmp_path / "r.safetensors")
    about = json.loads((tmp_path / "r.json").read_text())
    assert about["torchvision"] == {"name": "resnet18", "kwargs": {}}
    model = torchvision.models.get_model(
        about["torchvision"]["name"], num_classes=len(about["classes"]), **about["torchvision"]["kwargs"]
    )
    model.load_state_dict(load_file(str(tmp_path / "r.safetensors")))  # strict: every key, every shape
    assert model.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_bad_sources_and_a_missing_extra_are_one_line_each(small_run, tmp_path):
    run_folder, _ = small_run
    (tmp_path / "notes.txt").write_text("hello")
    for source, says in (
        (tmp_path / "notes.txt", "is not a checkpoint or an exported model"),
        (tmp_path / "empty", "does not exist"),
    ):
        p = run(trainer_cmd("export", str(source), "--format", "onnx"), check=False)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and says in p.stderr, p.stderr
    (tmp_path / "empty").mkdir()
    p = run(trainer_cmd("export", str(tmp_path / "empty"), "--format", "pt2"), check=False)
    assert p.returncode == 2 and "is not a checkpoint and holds none" in p.stderr, p.stderr
    # onnxruntime absent: an import of it fails, as where the extra was not installed
    code = (
        "import sys; sys.modules['onnxruntime'] = None; sys.argv = ['trainer'] + sys.argv[1:]; "
        "from trainer.cli import entry; entry()"
    )
    p = run(
        [sys.executable, "-c", code, "export", str(run_folder), "--format", "onnx", "--out", str(tmp_path / "x.onnx")],
        check=False,
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: --format onnx needs the onnxruntime package, which is not installed; pip install "
        "'cluster-trainer[export]'"
    ], p.stderr
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_exports_this_projects_networks_without_its_code(tmp_path, fmt):
    """airnet (a frozen whitening conv, a scaled head) in each format: the file's logits match."""
    ck = tmp_path / "ck"
    run(
        trainer_cmd(
            "train",
            *TINY,
            "model.name=airnet",
            "train.max_steps=2",
            "train.deterministic=false",
            f"checkpoint.dir={ck}",
        )
    )
    p = export(ck, fmt, tmp_path / f"a.{fmt}")
    assert f"{fmt}, airnet, 10 classes" in p.stderr, p.stderr
    if fmt == "safetensors":
        assert json.loads((tmp_path / "a.json").read_text())["torchvision"] is None, (
            "this project's network: no torchvision name"
        )


def test_an_exporter_that_cannot_take_the_model_is_one_line_and_a_traceback_file(small_run, tmp_path):
    """torch's exporter failing inside (as it does for an op it has no translation for): exit 1,
    one line naming the format and the error, the traceback in the file the line names."""
    run_folder, _ = small_run
    code = (
        "import sys, torch\n"
        "def fail(*a, **k):\n    raise RuntimeError('no translation for aten::made_up')\n"
        "torch.onnx.export = fail\n"
        "sys.argv = ['trainer'] + sys.argv[1:]\nfrom trainer.cli import entry\nentry()\n"
    )
    p = run(
        [sys.executable, "-c", code, "export", str(run_folder), "--format", "onnx", "--out", str(tmp_path / "m.onnx")],
        check=False,
    )
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and "the onnx export of" in lines[0] and "aten::made_up" in lines[0], (
        p.stderr
    )
    trace = Path(lines[0].split("the traceback is in ")[1].split(";")[0])
    assert "RuntimeError: no translation for aten::made_up" in trace.read_text()
