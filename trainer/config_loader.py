"""A config's YAML file and ``key=value`` overrides into a :class:`~trainer.config.Config`, and back.

Precedence is CLI > file > defaults. Each value is coerced to its field's type and named in one
line when it cannot be (:class:`~trainer.config.ConfigError`, exit 2 at the CLI); renamed and
removed keys say what to use instead. ``trainer config --explain`` prints every key with its type,
default and docstring. No torch import: the launchers and the tools venv read configs too.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from trainer.config import CIFAR_MODELS, TORCHVISION_MODELS, Config, ConfigError


def _sections(cfg: Config) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _fields(section: Any) -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(type(section))
    out = {}
    for f in dataclasses.fields(section):
        f.type = hints[f.name]
        out[f.name] = f
    return out


def valid_keys() -> list[str]:
    cfg = Config()
    return [f"{s}.{k}" for s, sec in _sections(cfg).items() for k in _fields(sec)]


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return " or ".join(_describe(a) for a in inner) + " or auto"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Convert a YAML value to the field's type or raise ConfigError naming the key and choices."""
    origin = get_origin(tp)
    bad = ConfigError(f"{key}={value!r} is not valid: expected {_describe(tp)}")
    if origin in (typing.Union, types.UnionType):
        if value is None or value == "auto":
            return None
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _coerce(key, inner[0], value)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise bad
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-4 (no dot) as text: a number all the same
            try:
                number = float(value)
            except ValueError:
                raise bad from None
            if not math.isfinite(number):
                raise bad
            return number
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if value is None or isinstance(value, (dict, list)):
            raise bad
        return str(value)
    raise bad  # pragma: no cover - every field type is handled above


def _unknown(key: str, choices: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, choices, n=1)
    hint = f"; did you mean {close[0]}?" if close else f"; valid keys: {', '.join(choices)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


RENAMED = {"optim.ema_every": "optim.lookahead_every"}
"""Old key -> its new name: configs saved with the old one (a run folder's config.yaml, a
checkpoint's) still load, with a one-line warning."""
REMOVED = {"dist.update_in_backward": "it bought no speed (BENCHMARKS.md)"}
"""Keys that no longer do anything: accepted with a one-line warning, so saved configs still load."""
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned and os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr)
    _warned.add(key)


def _apply(cfg: Config, key: str, value: Any) -> None:
    if key in REMOVED:
        _warn_once(key, f"config key {key} was removed ({REMOVED[key]}); ignoring it, delete it from the config")
        return
    if key in RENAMED:
        _warn_once(key, f"config key {key} is now {RENAMED[key]}; the old name still works, rename it")
        key = RENAMED[key]
    section_name, _, name = key.partition(".")
    sections = _sections(cfg)
    if section_name not in sections or not name:
        if section_name in sections:
            raise ConfigError(
                f"config key {key!r} names a section; set one of its keys, e.g. "
                f"{key}.{next(iter(_fields(sections[section_name])))}=..."
            )
        raise _unknown(key, valid_keys())
    section = sections[section_name]
    fields = _fields(section)
    if name not in fields:
        raise _unknown(key, [f"{section_name}.{k}" for k in fields])
    setattr(section, name, _coerce(key, fields[name].type, value))


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), base: Config | None = None
) -> Config:
    """Defaults (or ``base``), then the YAML file at ``path``, then ``key=value`` overrides; validated."""
    cfg = base if base is not None else Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {str(p)!r} does not exist; pass --config with a path such as configs/default.yaml"
            )
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" at line {line + 1}" if line is not None else ""
            raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}; fix the file") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections (model:, data:, ...)")
        for key, value in _flatten(tree).items():
            _apply(cfg, key, value)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. train.epochs=5")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _apply(cfg, key.strip(), value)
    return cfg.validate()


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def from_dict(tree: dict) -> Config:
    """Rebuild a Config from to_dict()'s output (e.g. the copy stored in a checkpoint)."""
    cfg = Config()
    for key, value in _flatten(tree).items():
        _apply(cfg, key, value)
    return cfg


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML; ``auto`` stands for None, as it is written in files."""
    tree = {s: {k: ("auto" if v is None else v) for k, v in sec.items()} for s, sec in to_dict(cfg).items()}
    return yaml.safe_dump(tree, sort_keys=False)


def explain() -> str:
    """Every key with its type, default and docstring (the attribute docstrings above)."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(Config)))
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for a, b in zip(body, body[1:], strict=False):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[(node.name, a.target.id)] = " ".join(str(b.value.value).split())
    lines = []
    for section_name, section in _sections(Config()).items():
        for name, f in _fields(section).items():
            default = getattr(section, name)
            doc = docs.get((type(section).__name__, name), "")
            shown = "auto" if default is None else default
            lines.append(f"{section_name}.{name} = {shown!r}  ({_describe(f.type)})\n    {doc}")
            if (section_name, name) == ("model", "name"):
                lines.append(f"    models: {', '.join(CIFAR_MODELS)}; torchvision's: {', '.join(TORCHVISION_MODELS)}")
    return "\n".join(lines)
