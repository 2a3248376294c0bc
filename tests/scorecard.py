"""The codebase's scorecard, for a maintainer (`make scorecard`; .ci/run prints it).

code lines      trainer/ (the installed package; the benchmarks live in bench/): lines with code, not blank, comment or
docstring
statements      Python statements there
long functions  functions there of more than LONG lines, their docstrings left out
import cycles   groups of trainer modules that import each other, at any depth (a function's
                local import counts: it hides the arrow, it does not remove it)
upward arrows   a module outside trainer/launch/ (the worker side, and what both sides share)
                importing one of trainer/launch/; the entry (trainer/cli.py, __main__) sits above
                both sides and may import either
across arrows   a module of trainer/launch/ importing one of trainer/worker/: the launcher's
                process reads what both sides share (contract, config, runfolder), never the worker's code
long lines      lines over 120 characters in trainer/ (with bench/) and tests/
fixed sleeps    time.sleep calls in tests outside a loop (a poll has a loop; a fixed wait is a
                guess at how long something takes, which a loaded machine makes wrong), but
                for a fault's or a pause's own length, marked ``# duration: ...``

python tests/scorecard.py [--json]
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainer"
LONG = 40
LAUNCHER, WORKER = "launch", "worker"
"""The subpackages of what runs in the launcher's process (torchrun's supervisor, Slurm, TorchX) and in each worker."""
ENTRY = ("cli", "__main__", "bench")
"""The command line above both sides (and the benchmarks, outside the package)."""
SUBPACKAGES = ("launch", "worker")


def modules(include_bench: bool = False) -> list[Path]:
    """The package's modules, and with ``include_bench`` the benchmarks' (bench/, outside it)."""
    return sorted([*PACKAGE.rglob("*.py"), *((ROOT / "bench").glob("*.py") if include_bench else [])])


def code_lines(path: Path) -> int:
    """Lines holding a token other than a comment, a string that is a docstring, or whitespace."""
    text = path.read_text()
    tree = ast.parse(text)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, node.end_lineno + 1))  # attribute docstrings too
    lines = set()
    skip = (
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
        tokenize.ENCODING,
    )
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip and tok.start[0] not in docstrings:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines)


def imports(path: Path) -> set[str]:
    """The trainer modules ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainer":
            parts = node.module.split(".")
            if len(parts) == 1:  # from trainer import x, y: modules x and y
                found.update(a.name for a in node.names)
            elif len(parts) == 2 and parts[1] in SUBPACKAGES:  # from trainer.worker import run: module worker.run
                found.update(f"{parts[1]}.{a.name}" for a in node.names)
            else:
                found.add(".".join(parts[1:]))
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("trainer."))
    return found


def module_name(path: Path) -> str:
    """trainer.X as X; the benchmarks' as bench.X."""
    if path.is_relative_to(ROOT / "bench"):
        return ".".join(["bench", *path.relative_to(ROOT / "bench").with_suffix("").parts])
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's length: the lines of its body, without its signature (one parameter a line once
    `ruff format` splits it) and its docstring (a TorchX component's Args, which `torchx run` shows
    as its help, are most of its lines)."""
    body = fn.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


DURATION = "# duration:"
"""Marks a sleep that is the length of what a test does (a link cut for 8 s), not a wait for something."""


def fixed_sleeps(path: Path) -> list[int]:
    text = path.read_text()
    tree, lines = ast.parse(text), text.splitlines()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "sleep":
            n = node
            while n in parents and not isinstance(n, (ast.While, ast.For)):
                n = parents[n]
            marked = (
                DURATION in lines[node.lineno - 1] or DURATION in lines[node.lineno - 2]
            )  # on its line or the one above
            if not isinstance(n, (ast.While, ast.For)) and not marked:
                found.append(node.lineno)
    return sorted(found)


def card() -> dict:
    files = modules()
    trees = {p: ast.parse(p.read_text()) for p in files}
    functions = [
        (f"{module_name(p)}.{n.name}", body_lines(n))
        for p, t in trees.items()
        for n in ast.walk(t)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    graph = {module_name(p): {m for m in imports(p) if m != module_name(p)} for p in modules(include_bench=True)}
    upward = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if m.split(".")[0] not in (LAUNCHER, *ENTRY) and d.split(".")[0] == LAUNCHER
    )
    across = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if m.split(".")[0] == LAUNCHER and d.split(".")[0] == WORKER
    )
    long_lines = {
        str(p.relative_to(ROOT)): n
        for p in [*modules(include_bench=True), *sorted((ROOT / "tests").glob("*.py"))]
        if (n := sum(len(line) > 120 for line in p.read_text().splitlines()))
    }
    sleeps = {p.name: lines for p in sorted((ROOT / "tests").glob("*.py")) if (lines := fixed_sleeps(p))}
    return {
        "code_lines": sum(code_lines(p) for p in files),
        "statements": sum(isinstance(n, ast.stmt) for t in trees.values() for n in ast.walk(t)),
        "long_functions": sorted(f"{name} ({n} lines)" for name, n in functions if n > LONG),
        "import_cycles": cycles(graph),
        "upward_arrows": upward,
        "across_arrows": across,
        "long_lines": sum(n for f, n in long_lines.items() if not f.startswith("tests/")),  # trainer/ and bench/
        "long_lines_tests": sum(n for f, n in long_lines.items() if f.startswith("tests/")),
        "long_lines_by_file": long_lines,
        "fixed_sleeps": sum(len(v) for v in sleeps.values()),
        "fixed_sleeps_by_file": sleeps,
    }


def main() -> None:
    c = card()
    if "--json" in sys.argv:
        print(json.dumps(c, indent=1))
        return
    print(f"code lines outside bench/    {c['code_lines']:,}")
    print(f"statements                   {c['statements']:,}")
    print(
        f"functions over {LONG} lines      {len(c['long_functions'])}"
        + "".join(f"\n    {f}" for f in c["long_functions"])
    )
    print(
        f"import cycles                {len(c['import_cycles'])}"
        + "".join(f"\n    {' <-> '.join(g)}" for g in c["import_cycles"])
    )
    print(f"upward arrows                {len(c['upward_arrows'])}" + "".join(f"\n    {a}" for a in c["upward_arrows"]))
    print(f"launch -> worker arrows      {len(c['across_arrows'])}" + "".join(f"\n    {a}" for a in c["across_arrows"]))
    print(f"lines over 120 characters    {c['long_lines']} in trainer/ and bench/, {c['long_lines_tests']} in tests/")
    print(
        f"fixed sleeps in tests        {c['fixed_sleeps']}"
        + "".join(f"\n    {f}: lines {', '.join(map(str, v))}" for f, v in c["fixed_sleeps_by_file"].items())
    )


if __name__ == "__main__":
    main()
