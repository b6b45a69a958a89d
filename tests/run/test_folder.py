"""The run folder contract (moelab.contract.folder) and the Job a folder's run.json selects (moelab.launch.jobs):
the launcher writes through RunFolder, Run reads through it, and Run asks its Job instead of branching on the
executor's name."""
import json
import os
import subprocess
import sys

import pytest

from moelab import Run
from moelab.launch.executors import job_for
from moelab.launch.jobs import ExternalJob, InlineJob, LocalJob, SlurmJob
from moelab.contract.folder import RunFolder, read_json, write_json


def test_names_and_info_round_trip(tmp_path):
    f = RunFolder(tmp_path / "r")
    assert not f.is_run() and not f.holds_run() and f.read_info() == {}
    f.path.mkdir()
    f.config.write_text("name: x\n")
    assert f.is_run() and not f.holds_run()  # a prepared folder: config only
    f.write_info({"executor": "inline", "status": "RUNNING"})
    assert f.holds_run() and f.info_path.name == "run.json"
    assert f.update_info(status="COMPLETED") == {"executor": "inline", "status": "COMPLETED"}
    assert json.loads(f.info_path.read_text())["status"] == "COMPLETED"
    assert f.rank_log(1, "err") == tmp_path / "r" / "logs" / "rank1.err"
    assert [p.name for p in (f.metrics, f.summary, f.checkpoints)] == ["metrics.jsonl", "summary.json", "checkpoints"]


def test_write_json_is_atomic(tmp_path):
    """A reader never sees a half-written file: the data goes to a temporary file, then os.replace."""
    path = tmp_path / "run.json"
    write_json(path, {"a": 1})
    inode = os.stat(path).st_ino
    write_json(path, {"a": 2, "b": "x" * 100000})
    assert read_json(path)["a"] == 2 and os.stat(path).st_ino != inode  # replaced, not rewritten in place
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    path.write_text('{"a": ')  # half a file (written by something else): None, not an exception
    assert read_json(path) is None


@pytest.mark.parametrize("executor, cls", [("inline", InlineJob), ("local", LocalJob), ("slurm", SlurmJob),
                                           (None, ExternalJob)])
def test_run_json_selects_the_job(tmp_path, executor, cls):
    f = RunFolder(tmp_path)
    if executor:
        f.write_info({"executor": executor, "job_id": "1", "submitit_folder": str(tmp_path)})
    assert type(job_for(f)) is cls
    assert Run(tmp_path).job.executor == (executor or "external")


def test_external_run_state_comes_from_its_stream_and_cannot_be_cancelled(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "start", "schema": 1, "env": {}}) + "\n")
    run = Run.load(tmp_path)
    assert run.executor == "external" and run.status == "RUNNING"
    with pytest.raises(RuntimeError, match="foreground"):
        run.cancel()
    with open(tmp_path / "metrics.jsonl", "a") as out:
        out.write(json.dumps({"event": "end", "schema": 1, "status": "COMPLETED"}) + "\n")
    assert Run.load(tmp_path).status == "COMPLETED"
    assert not (tmp_path / "run.json").exists()  # a folder written without a Session gets no run.json


def test_a_dead_local_controller_is_read_from_the_result_files(tmp_path):
    """The local Job: the controller (pid = job id) is gone and no task left a result: FAILED, or CANCELLED
    once a cancel was asked for, written back to run.json."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    f = RunFolder(tmp_path)
    f.write_info({"executor": "local", "job_id": str(dead.pid), "submitit_folder": str(tmp_path), "ntasks": 1})
    assert Run(tmp_path).status == "FAILED" and f.read_info()["status"] == "FAILED"
    f.write_info({"executor": "local", "job_id": str(dead.pid), "submitit_folder": str(tmp_path), "ntasks": 1,
                  "cancel_requested": True})
    assert Run(tmp_path).status == "CANCELLED"
