"""The README's shape (short, every launcher on its first screen) and every link between the docs."""

from __future__ import annotations

import re

from conftest import ROOT, run

DOCS = [ROOT / "README.md", ROOT / "RELIABILITY.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_readme_is_short_and_its_first_screen_shows_every_launcher_with_its_command():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    assert lines[2:6] == ["```bash", lines[3], lines[4], "```"] and lines[3].startswith("make run-local") and lines[4].startswith("make test")
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
