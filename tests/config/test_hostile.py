"""Issue 33.5: hostile configs through YAML, `--set` and Session are refused fast with a ConfigError naming the
field, in one readable line, before anything is submitted (moelab.config.bounds, moelab.config.yaml_io); so are
data paths and run or output folders that are a FIFO, a device, a folder where a file belongs or a file where a
folder belongs (moelab.config.paths)."""
from __future__ import annotations

import os
import re
import time

import pytest
import yaml

from moelab import Session
from moelab.config import ConfigError, load_config
from moelab.config.paths import check_path
from moelab.config.yaml_io import read_text

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


@pytest.fixture
def odd_paths(tmp_path):
    """{name: path}: a FIFO, a character device, a link to one, a folder, a regular file, nothing."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    (tmp_path / "file.txt").write_text("some text\n")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    return {"fifo": tmp_path / "fifo", "device": "/dev/zero", "link to a device": tmp_path / "zero.txt",
            "folder": tmp_path / "folder", "file": tmp_path / "file.txt", "nothing": tmp_path / "nothing"}


def test_a_path_is_taken_only_for_what_it_is(odd_paths):
    there = {"fifo": "a FIFO (named pipe), not", "device": "a character device, not",
             "link to a device": "a character device, not", "folder": "a folder, not", "file": "a regular file, not",
             "nothing": "no such"}
    accepts = {"file": {"file"}, "folder": {"folder"}, "file or folder": {"file", "folder"},
               "folder to write": {"folder", "nothing"}}
    for want, ok in accepts.items():
        for name, path in odd_paths.items():
            if name in ok:
                assert check_path("f.x", path, want, "fix it") == type(path)(path)
            else:
                refused(lambda: check_path("f.x", path, want, "fix it"),
                        rf"^f\.x='{re.escape(str(path))}': {re.escape(there[name])} .*; fix it$")
    refused(lambda: read_text(odd_paths["fifo"], "data.chat_template", "give a jinja file"),  # never blocks
            "data.chat_template .* cannot be read .not a regular file.; give a jinja file")


@pytest.mark.parametrize("name", ["fifo", "device", "link to a device", "folder", "nothing"])
def test_data_paths_that_are_no_file_are_refused_before_submission(odd_paths, name, tmp_path):
    path = str(odd_paths[name])
    cases = [({"kind": "tokens", "path": path}, "data.path", "give a flat file of uint16 token ids")]
    if name != "folder":  # a text corpus may be a folder; a tokenizer may be one holding tokenizer.json
        cases += [({"kind": "text", "path": path}, "data.path", "give a text file, a folder, a glob"),
                  ({"kind": "text", "path": str(odd_paths["file"]), "tokenizer": path}, "data.tokenizer",
                   "give 'bytes', 'bpe', a tokenizer.json file")]
    if name not in ("folder", "nothing"):
        cases.append(({"kind": "text", "path": str(odd_paths["file"]), "cache_dir": path}, "data.cache_dir",
                      "set data.cache_dir or .MOELAB_CACHE to a writable folder"))
    for data, field, fix in cases:
        session = Session("tiny", data=data, train={"device": "cpu"})
        refused(lambda: session.submit("inline", folder=tmp_path / "run"),
                rf"^{field}='{re.escape(path)}': (.*, not|no such) .*; {fix}")
        assert not (tmp_path / "run").exists()  # refused before the folder was made


@pytest.mark.parametrize("name", ["fifo", "device", "link to a device", "file"])
def test_run_folders_that_are_no_folder_are_refused_with_the_field_and_the_fix(odd_paths, name, tmp_path):
    path = odd_paths[name]
    match = rf"^folder='{re.escape(str(path))}': .*, not a folder; give a new folder, or a folder of yours"
    refused(lambda: Session("tiny", train={"device": "cpu"}).submit("inline", folder=path), match)
    refused(lambda: Session("tiny", train={"device": "cpu"}).sweep({"train.lr": [1e-3]}, "inline", folder=path),
            match)
    if name == "fifo":  # the command line: one line, exit code 2, nothing written
        out = moelab("run", "tiny", *SMALL_CLI, "--out", path)
        assert out.returncode == 2 and out.stderr.startswith(f"moelab: config error: folder='{path}': a FIFO")
        assert len(out.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "file.txt", "folder", "zero.txt"]
