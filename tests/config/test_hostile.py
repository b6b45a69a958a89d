"""Issue 33.5: hostile configs through YAML, `--set` and Session are refused fast with a ConfigError naming the
field, in one readable line, before anything is submitted (moelab.config.bounds, moelab.config.yaml_io)."""
from __future__ import annotations

import time

import pytest
import yaml

from moelab import Session
from moelab.config import ConfigError, load_config

from support import SMALL_CLI
from support import moelab_cli as moelab

# (dotted key, value, what the error must say): each was accepted, hung, or crashed a rank before
VALUES = [
    ("name", "../../tmp/x", r"^name='\.\./\.\./tmp/x': must be 1-128 characters"),
    ("name", "a\0b", r"^name='a\\x00b': must be"),
    ("name", "x" * 100_000, r"^name='xxx.*\(100002 characters\): must be"),
    ("train.global_batch_size", 2**40, r"^train.global_batch_size=1099511627776: must be at most 2\*\*31-1"),
    ("train.global_batch_size", 2**26, r"^train.global_batch_size=67108864: times train.seq_len=64 gives"),
    ("train.steps", 1e30, r"^train.steps=10000000000000000\d+: must be at most 2\*\*31-1"),
    ("train.seed", 2**63, r"^train.seed=9223372036854775808: must be within \[0, 2\*\*62\)"),
    ("train.seed", -1, r"^train.seed=-1: must be within"),
    ("model.hidden_size", 2**40, r"^model.hidden_size=1099511627776: must be at most"),
    ("model.hidden_size", 2**30, r"^model.vocab_size=\d+: with model.hidden_size=1073741824 makes a weight"),
    ("model.moe.num_experts", 2**32, r"^model.moe.num_experts=4294967296: must be at most"),
    ("train.seq_len", 2**63, r"^train.seq_len=9223372036854775808: must be at most"),
    ("model.vocab_size", 2**40, r"^model.vocab_size=1099511627776: must be at most"),
    ("train.init_from", "y" * 1_000_000, r"^train.init_from='yyy.*\(1000002 characters\): give ''"),
]


def nested(key: str, value) -> dict:
    *parts, last = key.split(".")
    d = node = {}
    for p in parts:
        node = node.setdefault(p, {})
    node[last] = value
    return d


def refused(make, match: str) -> ConfigError:
    """The ConfigError `make` raises: one line of at most 1000 characters, in seconds (the alias bomb and
    /dev/zero used to run without end; 20 s leaves room for pure-Python YAML reading 1 MB on a busy machine)."""
    start = time.monotonic()
    with pytest.raises(ConfigError, match=match) as e:
        make()
    message = str(e.value)
    assert time.monotonic() - start < 20 and "\n" not in message and len(message) <= 1000, message[:300]
    return e.value


@pytest.mark.parametrize("key,value,match", VALUES, ids=[f"{k}={str(v)[:12]}" for k, v, _ in VALUES])
def test_out_of_bound_values_are_refused_through_yaml_set_and_session(key, value, match, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"base": "tiny", **nested(key, value)}))
    refused(lambda: load_config(path), match)                                        # a YAML file
    refused(lambda: load_config("tiny", [f"{key}={yaml.safe_dump(value, width=10**7).strip()}"]), match)  # --set
    refused(lambda: Session("tiny", **nested(key, value)), match)                    # Session


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9))
FILES = [
    ("alias bomb", "base: tiny\ndata:\n  path: x\nbomb:\n" + "".join(f"  {line}\n" for line in BOMB.splitlines()),
     "aliases .* expand to more than 100000"),
    ("self-referencing alias", "base: tiny\nloop: &l [*l]\n", "refers to a value that contains it"),
    ("empty", "", "the file sets nothing"),
    ("comments only", "# nothing\n# here\n", "the file sets nothing"),
    ("over 1 MiB", "base: tiny\n" + "#" * (1 << 20) + "\n", "larger than 1048576 bytes"),
    ("base: /dev/zero", "base: /dev/zero\n", "'/dev/zero' cannot be read .not a regular file"),
]


@pytest.mark.parametrize("text,match", [(t, m) for _, t, m in FILES], ids=[n for n, _, _ in FILES])
def test_hostile_config_files_are_refused_fast(text, match, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    refused(lambda: load_config(path), match)
    refused(lambda: Session(str(path)), match)


def test_hostile_sources_and_set_values():
    refused(lambda: Session("/dev/zero"), "cannot be read .not a regular file")
    refused(lambda: Session("tiny\0"), "a NUL byte")
    refused(lambda: load_config("tiny", ["train.lr=" + BOMB.replace("\n", ", ").join("{}")]),
            "aliases .* expand to more than 100000")
    refused(lambda: load_config("tiny", ["z" * 1_000_000 + "=1"]), r"\(\d+ characters\)")


def test_a_hostile_name_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
    out = moelab("run", "tiny", *SMALL_CLI, "--set", "name=../../x", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("moelab: config error: name='../../x'"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_a_yaml_files_stem_becomes_a_safe_default_name(tmp_path):
    path = tmp_path / "my run (v2).yaml"
    path.write_text("base: tiny\n")
    assert load_config(path).name == "my-run--v2-"
