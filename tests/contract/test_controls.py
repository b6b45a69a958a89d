"""Issue 42.2, 42.4, 42.5: controls.jsonl (moelab.contract.controls). Every append starts on a new line, so a
line cut by a crash mid-append stays a damaged line of its own (skipped with a ControlsWarning naming it) and the
next request is whole; a full disk or a read-only folder is one FolderWriteError with nothing left behind (no
empty controls.jsonl); readers read only what was appended since their last read.

The disks are real tmpfs mounts (the `tmpfs` fixture, tests/conftest.py; root only, skipped without)."""
from __future__ import annotations

import json
import warnings

import pytest

import moelab.contract.controls as controls
from moelab.contract.controls import (ControlsFile, ControlsWarning, append_control, append_request, holding,
                                      read_controls)
from moelab.contract.writes import FolderWriteError
from support import fill_disk as fill


def test_a_line_cut_by_a_crash_is_skipped_and_the_next_request_is_whole(tmp_path):
    first = append_request(tmp_path, {"train.lr": 0.1}, who="test")
    with open(tmp_path / "controls.jsonl", "ab") as f:  # a writer killed mid-append: no newline
        f.write(b'{"time": 1.0, "kind": "request", "id": "cut", "chan')
    second = append_request(tmp_path, {"train.lr": 0.2}, who="test")
    append_control(tmp_path, {"kind": "applied", "id": second, "step": 4, "changes": {"train.lr": [0.1, 0.2]}})
    with pytest.warns(ControlsWarning, match=r"controls.jsonl:2: not a control line .*skipped"):
        requests, outcomes = ControlsFile(tmp_path).read().requests, ControlsFile(tmp_path).read().outcomes
    assert [r["id"] for r in requests] == [first, second]
    assert [r["changes"] for r in requests] == [{"train.lr": 0.1}, {"train.lr": 0.2}]
    assert outcomes[second]["step"] == 4
    assert (tmp_path / "controls.jsonl").read_bytes().count(b"\n") == 4  # the cut line ended, nothing glued


def test_a_half_written_last_line_waits_for_its_newline(tmp_path):
    append_request(tmp_path, {"train.lr": 0.1}, who="test")
    f = ControlsFile(tmp_path).read()
    line = (json.dumps({"kind": "request", "id": "x", "who": "t", "changes": {"train.lr": 0.3}}) + "\n").encode()
    with open(tmp_path / "controls.jsonl", "ab") as out:
        out.write(line[:20])  # the writer is mid-line
        out.flush()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not damage: no warning
            assert len(f.read().requests) == 1
        out.write(line[20:])
    assert [r["id"] for r in f.read().requests][-1] == "x"


def test_readers_read_only_what_was_appended(tmp_path, monkeypatch):
    # issue 42.5: about 10 MiB of earlier requests and outcomes, then 200 more requests, each followed by a read
    path = tmp_path / "controls.jsonl"
    line = {"kind": "applied", "id": "0", "step": 1, "changes": {"train.lr": [0.1, 0.2]}, "pad": "x" * 900}
    path.write_bytes(b"".join((json.dumps({**line, "id": str(i)}) + "\n").encode() for i in range(10_000)))
    read = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, n):
            self.f.seek(n)

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr(controls, "open", lambda p, mode="r": Counting(real_open(p, mode)), raising=False)
    f = ControlsFile(tmp_path).read()
    assert sum(read) == path.stat().st_size > 9_000_000 and len(f.outcomes) == 10_000
    assert len(controls.reader(tmp_path).outcomes) == 10_000  # the process's reader (Run.set's), read once
    read.clear()
    for i in range(200):
        rid = append_request(tmp_path, {"train.lr": 0.001 * (i + 1)}, who="test")
        assert f.read().requests[-1]["id"] == rid
        assert controls.reader(tmp_path).latest == {"train.lr": 0.2}
    assert len(f.requests) == 200
    assert sum(read) < 2 * 200 * 200  # each request's line (under 200 bytes) read once per reader, no more


def test_a_full_disk_is_one_error_and_leaves_no_controls_file(tmpfs):
    disk = tmpfs(64 * 1024)
    fill(disk)
    with pytest.raises(FolderWriteError, match="disk full") as e:
        append_request(disk, {"train.lr": 0.1, "pad": "x" * 8192}, who="test")
    assert e.value.path == disk / "controls.jsonl"
    assert not (disk / "controls.jsonl").exists()  # the file the failed append created is gone
    (disk / "filler").unlink()
    first = append_request(disk, {"train.lr": 0.1}, who="test")
    before = (disk / "controls.jsonl").read_bytes()
    fill(disk)
    with pytest.raises(FolderWriteError, match="disk full"):
        append_request(disk, {"train.lr": 0.2, "pad": "x" * 8192}, who="test")
    assert (disk / "controls.jsonl").read_bytes() == before  # taken back whole
    (disk / "filler").unlink()
    second = append_request(disk, {"train.lr": 0.3}, who="test")
    assert [r["id"] for r in read_controls(disk)[0]] == [first, second]


def test_a_read_only_folder_is_one_error_and_writes_nothing(tmpfs):
    disk = tmpfs(64 * 1024)
    tmpfs.read_only(disk)
    with pytest.raises(FolderWriteError, match="read-only file system"):
        append_request(disk, {"train.lr": 0.1}, who="test")
    with pytest.raises(FolderWriteError, match="read-only file system"):
        with holding(disk):
            pass
    assert list(disk.iterdir()) == []
