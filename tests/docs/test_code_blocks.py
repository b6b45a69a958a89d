"""Every code block in README.md and docs/*.md is checked against the code, so the docs cannot drift from it:

- ```python: parsed; every `moelab` name it imports or reaches (`moelab.runs`, `from moelab.hf import ...`)
  resolves, and every method or attribute it uses on a Session, Run or Sweep (by the variable names the docs use
  for them) exists on that class;
- ```bash: each `moelab ...` command line is parsed by the command's own parser (subcommands, flags), and the
  `--set` overrides of `run` / `plan` / `bench` on a preset are validated as a config;
- ```text: each `moelab: config error: ...` line is the error the config rules give for that override on tiny.
A block of another language, or without one, fails: say what it is.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import shlex
from pathlib import Path

import pytest

import moelab
from moelab.cli import build_parser
from moelab.config import ConfigError, load_config
from moelab.presets import preset_names

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# The variable names the docs give the public nouns, and their classes.
NOUNS = {"s": moelab.Session, "session": moelab.Session, "run": moelab.Run, "child": moelab.Run,
         "sweep": moelab.Sweep}


def _blocks():
    for path in DOCS:
        for m in BLOCK.finditer(path.read_text()):
            line = path.read_text()[:m.start()].count("\n") + 1
            yield pytest.param(m.group(1), m.group(2), id=f"{path.relative_to(ROOT)}:{line}")


def _has(cls, name: str) -> bool:
    """A class attribute, or an instance attribute its methods assign (`self.name = ...`)."""
    if hasattr(cls, name):
        return True
    return any(re.search(rf"\bself\.{name}\s*[:=]", inspect.getsource(c)) for c in cls.__mro__ if c.__module__.startswith("moelab"))


def _check_python(code: str) -> None:
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "moelab":
            mod = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(mod, alias.name), f"`from {node.module} import {alias.name}`: no such name"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "moelab":
                    importlib.import_module(alias.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = node.value.id
            if owner == "moelab":
                assert hasattr(moelab, node.attr), f"moelab.{node.attr}: no such name"
            elif owner in NOUNS:
                assert _has(NOUNS[owner], node.attr), f"{owner}.{node.attr}: {NOUNS[owner].__name__} has no {node.attr}"
            elif owner in ("Run", "Session", "Sweep"):
                assert hasattr(getattr(moelab, owner), node.attr), f"{owner}.{node.attr}: no such attribute"


def _commands(code: str):
    """The `moelab` command lines of a bash block: continuations joined, comments dropped, `;`/`&&` split."""
    text = re.sub(r"\\\n\s*", " ", code)
    for line in text.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        for part in re.split(r"\s*(?:;|&&)\s*", line):
            words = shlex.split(part.split(" | ")[0]) if part else []
            if words[:1] == ["moelab"]:
                yield words[1:]


def _check_bash(code: str) -> None:
    parser = build_parser()
    for argv in _commands(code):
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"`moelab {' '.join(argv)}`: the command's parser refuses it")
        config = getattr(args, "config", None)
        if args.command in ("run", "plan", "bench") and config in preset_names():
            try:
                load_config(config, list(getattr(args, "overrides", None) or []))
            except ConfigError as e:
                pytest.fail(f"`moelab {' '.join(argv)}`: {e}")


def _check_text(code: str) -> None:
    for line in code.splitlines():
        m = re.match(r"moelab: config error: (([\w.]+)=(\S+)): (.*)$", line)
        assert m, f"a text block holds `moelab: config error:` lines only, got: {line}"
        with pytest.raises(ConfigError) as e:
            load_config("tiny", [m.group(1)])
        assert str(e.value) == f"{m.group(1)}: {m.group(4)}"


@pytest.mark.parametrize("lang,code", list(_blocks()))
def test_code_block_matches_the_code(lang: str, code: str):
    checks = {"python": _check_python, "bash": _check_bash, "text": _check_text}
    assert lang in checks, f"a code block without a known language ({lang!r}): mark it python, bash or text"
    checks[lang](code)


def test_blocks_are_found():
    """The scan sees the README's tour and the set-up commands (a changed fence style would check nothing)."""
    langs = [p.values[0] for p in _blocks()]
    assert langs.count("python") >= 3 and langs.count("bash") >= 4


def test_a_drifted_block_fails():
    """The checks fail on what drifts: a renamed method, an unknown flag, an unknown config field."""
    with pytest.raises(AssertionError):
        _check_python("run = s.submit()\nrun.no_such_method()")
    with pytest.raises(pytest.fail.Exception):
        _check_bash("moelab run tiny --no-such-flag")
    with pytest.raises(pytest.fail.Exception):
        _check_bash("moelab run tiny --set model.moe.num_experst=4")
