"""Issue 33.3: every write to a run folder goes through moelab.contract.writes. A full disk or a read-only folder
gives FolderWriteError (cause, path, bytes needed and free), leaves no temporary file and the files as they
were; readers of a finished run in a read-only folder work and write nothing.

The disks are real: a small tmpfs (full) and a tmpfs remounted read-only (the `tmpfs` fixture, tests/conftest.py),
which need root (the CI machine runs tests as root, where chmod would not stop a write); skipped without."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from moelab.contract.events import EndEvent, StartEvent, StepEvent
from moelab.contract.folder import RunFolder, write_json
from moelab.contract.stream import MetricsWriter
from moelab.contract.writes import FolderWriteError, append_line, write_atomic, write_if_possible
from support import fill_disk

def test_a_full_disk_is_a_clear_error_and_leaves_the_files_as_they_were(tmpfs):
    disk = tmpfs(256 * 1024)
    run = RunFolder(disk / "run")
    run.path.mkdir()
    run.write_info({"executor": "inline", "status": "RUNNING"})
    w = MetricsWriter(run.metrics)
    w.emit(StartEvent(config={"name": "x"}, total_steps=3))
    w.emit(StepEvent(step=1, loss=2.0))
    before = {p.name: p.read_bytes() for p in run.path.iterdir()}
    fill_disk(disk)

    with pytest.raises(FolderWriteError) as e:
        run.update_info(status="COMPLETED", note="x" * 20_000)
    assert e.value.cause == "disk full" and e.value.path == run.info_path and e.value.need > 20_000
    assert e.value.free < 4096 and "disk full" in str(e.value) and str(run.info_path) in str(e.value)
    assert "moelab resume" in str(e.value)  # the way on, once there is space

    with pytest.raises(FolderWriteError, match="disk full") as e:
        w.emit(StepEvent(step=2, loss=1.5, comm={"pad": "y" * 20_000}))
    assert e.value.path == run.metrics
    with pytest.raises(FolderWriteError, match="disk full"):
        write_json(run.summary, {"final_loss": 1.0, "pad": "z" * 20_000})

    after = {p.name: p.read_bytes() for p in run.path.iterdir()}
    assert after == before, "no temporary file, no half line, nothing changed"
    (disk / "filler").unlink()  # space again: the run goes on where it was
    w.emit(EndEvent(step=1, status="PREEMPTED"))
    assert run.metrics.read_text().count("\n") == 3


def test_append_line_takes_back_a_line_cut_short_by_a_full_disk(tmpfs):
    disk = tmpfs(64 * 1024)
    path = disk / "metrics.jsonl"
    path.write_bytes(b'{"event": "start"}\n')
    fill_disk(disk)
    with pytest.raises(FolderWriteError):
        append_line(path, b"x" * 100_000 + b"\n")
    assert path.read_bytes() == b'{"event": "start"}\n'


@pytest.fixture
def read_only(tmp_path, tmpfs):
    """make(folder) -> `folder` moved onto a file system remounted read-only."""
    def make(folder: Path) -> Path:
        disk = tmpfs(4 << 20)
        subprocess.run(["cp", "-a", str(folder), str(disk)], check=True)
        tmpfs.read_only(disk)
        return disk / folder.name

    return make


def finished_runs(root: Path) -> list[Path]:
    """Two finished runs whose status a reader learns from the stream and would record in run.json: an inline
    run whose owner process is gone, and a local run whose controller is gone (no status in run.json)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    folders = []
    for name, info in (("inline", {"executor": "inline", "status": "RUNNING", "pid": int(dead),
                                   "host": socket.gethostname()}),
                       ("local", {"executor": "local", "job_id": dead, "ntasks": 1,
                                  "submitit_folder": str(root / f"gone-{uuid.uuid4().hex}")})):
        run = RunFolder(root / name)
        run.path.mkdir(parents=True)
        run.write_info(info)
        (run.config).write_text("name: x\n")
        w = MetricsWriter(run.metrics)
        w.emit(StartEvent(config={"name": name}, total_steps=2))
        w.emit(StepEvent(step=1, loss=2.0))
        w.emit(StepEvent(step=2, loss=1.0))
        w.emit(EndEvent(step=2, status="COMPLETED"))
        folders.append(run.path)
    return folders


def test_readers_of_a_finished_run_in_a_read_only_folder_work_and_write_nothing(tmp_path, read_only):
    import moelab
    from moelab import Run

    runs = read_only(tmp_path / "runs") if finished_runs(tmp_path / "runs") else None
    inline, local = runs / "inline", runs / "local"
    with pytest.raises(OSError):
        (runs / "probe").write_text("x")  # really read-only
    assert Run.load(inline).status == "COMPLETED"  # its owner is gone: the stream's end decides
    assert Run.load(local).status == "COMPLETED"
    table = moelab.runs(runs).table
    assert list(table["status"]) == ["COMPLETED", "COMPLETED"] and list(table["step"]) == [2, 2]
    out = subprocess.run([sys.executable, "-m", "moelab", "status", str(runs)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[COMPLETED]  step 2/2" in out.stdout and "Traceback" not in out.stderr
    assert json.loads((local / "run.json").read_text()).get("status") is None  # nothing was written
    assert json.loads((inline / "run.json").read_text())["status"] == "RUNNING"


def test_where_the_folder_is_writable_a_reader_still_records_what_it_learnt(tmp_path):
    from moelab import Run

    inline, local = finished_runs(tmp_path / "runs")
    assert Run.load(local).status == Run.load(inline).status == "COMPLETED"
    assert json.loads((local / "run.json").read_text())["status"] == "COMPLETED"
    assert "owner process gone" in json.loads((inline / "run.json").read_text())["error"]
    assert write_if_possible(lambda: write_atomic(local / "x", b"1"))
