"""The README's shape (short, every launcher on its first screen), every link between the docs, and the
commands of docs/your-images.md's fine-tuning path, run as written."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, run

DOCS = [ROOT / "README.md", ROOT / "RELIABILITY.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_readme_is_short_and_its_first_screen_shows_every_launcher_with_its_command():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    assert (
        lines[2:6] == ["```bash", lines[3], lines[4], "```"]
        and lines[3].startswith("make run-local")
        and lines[4].startswith("make test")
    )
    first = "\n".join(lines[:40])
    for where in ("this machine", "Docker", "Trainer v2", "PyTorchJob", "TorchX", "Slurm"):
        assert re.search(rf"^\| [^|]*{where}[^|]* \| `[^`]+` \| \[", first, re.M), where
    targets = run(["make", "--no-print-directory", "help"]).stdout
    for cmd in re.findall(r"^\| [^|]+ \| `make ([a-z0-9-]+)", first, re.M):
        assert f"  {cmd} " in targets, cmd


def test_every_link_between_the_docs_reaches_a_file_and_a_heading():
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(((?!https?:)[^)#\s]*)(?:#([^)\s]+))?\)", doc.read_text()):
            path = (doc.parent / target) if target else doc
            assert path.exists(), f"{doc.name}: {target}"
            if anchor:
                assert anchor in anchors(path.read_text()), f"{doc.name}: {target}#{anchor}"


def bash_blocks(text: str, after: str) -> list[str]:
    """The command lines of the bash blocks that follow the heading ``after``, up to the next heading."""
    section = text.split(after, 1)[1].split("\n## ", 1)[0]
    return [
        line for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.splitlines() if line.strip()
    ]


@pytest.mark.slow
def test_your_images_three_commands_to_a_served_model_run_as_written(tmp_path):
    """docs/your-images.md's fine-tuning path, every command as written, in a folder that holds a
    small `myset` (made JPEGs, 32 px: seconds for ResNet-50 on a CPU) and the repository's configs;
    torchvision's DEFAULT ResNet-50 file is one made here, in $TORCH_HOME (no download)."""
    import shutil

    import torch
    from conftest import env, make_jpegs

    from trainer.worker import models

    lines = bash_blocks((ROOT / "docs" / "your-images.md").read_text(), "## From a pretrained model to one you serve")
    assert [line.split()[:2] for line in lines] == [
        ["trainer", "data"],
        ["trainer", "train"],
        ["trainer", "export"],
        ["trainer", "predict"],
        ["trainer", "eval"],
    ], lines
    make_jpegs(tmp_path / "myset", train=20, test=4)
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    hub = tmp_path / "torch" / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    # DEFAULT: IMAGENET1K_V2's file
    torch.save(models.build("resnet50", 1000, 224).state_dict(), hub / "resnet50-11ad3fa6.pth")
    e = env(TORCH_HOME=str(tmp_path / "torch"))
    out = {}
    for line in lines:
        out[line] = run(["bash", "-c", line], cwd=tmp_path, env=e, timeout=900)
    train = out[lines[1]].stdout
    assert "resnet50 |" in train and "weights ResNet50_Weights.IMAGENET1K_V2 (normalised by mean 0.485" in train, train[
        -2000:
    ]
    assert "largest logit difference from PyTorch" in out[lines[2]].stderr and (tmp_path / "myset.onnx").is_file()
    assert len((tmp_path / "predictions.csv").read_text().splitlines()) == 1 + 40
    assert (tmp_path / "report" / "confusion.png").is_file() and "accuracy (recall)" in out[lines[4]].stdout
