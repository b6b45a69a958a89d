"""The run folder's writer lock (moelab.contract.folder.FolderLock), with real processes: a second writer is refused
naming the owner, the lock of a killed owner is taken over, and re-entry in one process is allowed; a folder that
cannot be written (read-only, full) is the FolderWriteError of any write there, and no lock stays held."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moelab.contract import folder as folder_module
from moelab.contract.folder import FolderLocked, lock_folder, read_owner
from moelab.contract.writes import FolderWriteError
from support import SMALL_CLI, moelab_cli

HOLD = ("import sys, time\nfrom moelab.contract.folder import lock_folder\nlock_folder(sys.argv[1], 'test holder')\n"
        "print('held', flush=True)\ntime.sleep(600)\n")


def _holder(folder):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_writer_is_refused_naming_the_owner_and_a_dead_owner_is_taken_over(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(FolderLocked) as e:
            lock_folder(tmp_path / "run", "second")
        assert e.value.owner["pid"] == holder.pid and f"pid {holder.pid}" in str(e.value)
        assert "test holder" in str(e.value)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert read_owner(tmp_path / "run")["pid"] == holder.pid  # the file still names the dead owner: stale
    lock = lock_folder(tmp_path / "run", "taker")               # ... and is taken over
    assert read_owner(tmp_path / "run")["pid"] == os.getpid()
    with lock_folder(tmp_path / "run", "inline"):                # re-entrant in the owning process
        assert read_owner(tmp_path / "run")["role"] == "inline"
    lock.release()
    assert read_owner(tmp_path / "run") == {}                   # released cleanly: no owner
    again = _holder(tmp_path / "run")                           # and another process may take it
    again.kill()
    again.wait()


def test_a_submitter_lock_is_waited_for_by_the_job_it_submitted(tmp_path):
    """A submitted job that starts before its submitter has written run.json waits for it, not refuses."""
    code = ("import sys, time\nfrom moelab.contract.folder import lock_folder\nl = lock_folder(sys.argv[1], 'submit')\n"
            "print('held', flush=True)\nsys.stdin.readline()\nl.release()\nprint('released', flush=True)\n"
            "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(FolderLocked):
            lock_folder(tmp_path, "rank 0")           # no waiting asked: refused at once
        p.stdin.write("\n")
        p.stdin.flush()
        start = time.monotonic()
        lock = lock_folder(tmp_path, "rank 0", wait_s=300)
        assert time.monotonic() - start < 300 and read_owner(tmp_path)["role"] == "rank 0"
        lock.release()
    finally:
        p.kill()
        p.wait()


# ---------------------------------------------------------------------- an owner on another host
def _fake_owner(folder, **owner):
    """A lock file as a writer on another host leaves it (a file system need not share flocks between hosts, so
    only the file tells this host about that owner)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".lock").write_text(json.dumps({"pid": 424242, "host": "node-elsewhere", "role": "rank 0",
                                              "since": time.time(), **owner}))


def test_an_owner_on_another_host_without_a_slurm_job_is_held_until_unlocked(tmp_path, capsys, monkeypatch):
    from moelab.cli import main

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _fake_owner(tmp_path / "run")
    with pytest.raises(FolderLocked) as e:
        lock_folder(tmp_path / "run", "inline")
    assert "pid 424242 on node-elsewhere" in str(e.value) and "names no SLURM job" in str(e.value)
    assert f"moelab unlock {tmp_path / 'run'}" in str(e.value)
    assert read_owner(tmp_path / "run")["pid"] == 424242  # the refusal left the lock as it was

    assert main(["unlock", str(tmp_path / "run")]) == 0
    assert "pid 424242 on node-elsewhere" in capsys.readouterr().out
    with lock_folder(tmp_path / "run", "inline"):          # the next writer takes it
        assert read_owner(tmp_path / "run")["pid"] == os.getpid()
    assert main(["unlock", str(tmp_path / "run")]) == 0    # released cleanly: nothing to unlock
    assert "nothing to unlock" in capsys.readouterr().out

    _fake_owner(tmp_path / "other", slurm_job_id="999999999", job_id="999999999")
    with pytest.raises(FolderLocked, match="job 999999999"):  # a job SLURM does not know (or no SLURM here)
        lock_folder(tmp_path / "other", "inline")


def test_a_lock_left_by_an_earlier_attempt_of_this_slurm_job_is_stale(tmp_path, monkeypatch):
    """SLURM runs one attempt of a job at a time: a requeued job's rank 0 takes over its own earlier lock."""
    _fake_owner(tmp_path, slurm_job_id="31337", job_id="31337")
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    with lock_folder(tmp_path, "rank 0"):
        assert read_owner(tmp_path)["pid"] == os.getpid() and read_owner(tmp_path)["slurm_job_id"] == "31337"


def test_a_lock_of_a_slurm_job_is_held_while_the_job_runs_and_stale_once_it_ends(tmp_path, slurm_cluster,
                                                                                  monkeypatch):
    """A real job on the local cluster takes the lock and ends without releasing it (os._exit, as a killed job
    does). Seen from another host (the lock's host renamed: this cluster has one node), SLURM decides."""
    from moelab.contract.folder import SLURM_ENDED, break_lock, slurm_job_state

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run, stop = tmp_path / "run", tmp_path / "stop"
    code = ("import os, sys, time\nfrom pathlib import Path\nfrom moelab.contract.folder import lock_folder\n"
            "lock_folder(sys.argv[1], 'rank 0')\nwhile not Path(sys.argv[2]).exists(): time.sleep(0.2)\n"
            "os._exit(0)\n")
    (tmp_path / "hold.py").write_text(code)
    out = subprocess.run(["sbatch", "--parsable", "-o", str(tmp_path / "job.out"), "--wrap",
                          f"{sys.executable} {tmp_path / 'hold.py'} {run} {stop}"],
                         capture_output=True, text=True, check=True)
    job = out.stdout.strip().split(";")[0]
    try:
        end = time.monotonic() + 300
        while read_owner(run).get("slurm_job_id") != job:
            assert slurm_job_state(job) not in SLURM_ENDED, (tmp_path / "job.out").read_text()
            assert time.monotonic() < end, f"job {job} never took the lock: {slurm_job_state(job)}"
            time.sleep(0.3)
        with pytest.raises(FolderLocked, match=f"job {job}"):  # on its own host: the flock refuses
            lock_folder(run, "inline")

        owner = {**read_owner(run), "host": "node-elsewhere"}
        (run / ".lock").write_text(json.dumps(owner))       # the job's lock as another host reads it
        with pytest.raises(FolderLocked, match=f"SLURM job {job} is RUNNING"):
            lock_folder(run, "inline")
        with pytest.raises(FolderLocked, match=f"SLURM job {job} is RUNNING"):
            break_lock(run)                                   # `moelab unlock` refuses a running job's lock
        _fake_owner(tmp_path / "unheld", slurm_job_id=job)     # no flock held, the file alone names the job
        with pytest.raises(FolderLocked, match="RUNNING"):
            lock_folder(tmp_path / "unheld", "inline")
    finally:
        stop.touch()
    while slurm_job_state(job) not in SLURM_ENDED:
        assert time.monotonic() < end, f"job {job} did not end: {slurm_job_state(job)}"
        time.sleep(0.3)
    assert read_owner(run)["slurm_job_id"] == job          # it ended without releasing: the file names it
    with lock_folder(run, "inline"):                        # ... and SLURM says it has ended: stale
        assert read_owner(run)["pid"] == os.getpid()

    # a flock still held for a host whose job has ended (a lock server that has not noticed): a fresh lock file
    holder = _holder(tmp_path / "held")
    try:
        _fake_owner(tmp_path / "held", slurm_job_id=job)
        with lock_folder(tmp_path / "held", "inline"):
            assert read_owner(tmp_path / "held")["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()


def test_a_read_only_or_full_folder_is_a_folder_write_error_and_no_lock_stays_held(tmpfs):
    disk = tmpfs(64 * 1024)
    (disk / "old").mkdir()
    tmpfs.read_only(disk)
    for folder in (disk / "old", disk / "new"):  # the lock file, or the folder itself, cannot be made
        with pytest.raises(FolderWriteError) as e:
            lock_folder(folder, "inline")
        assert e.value.cause == "read-only file system" and e.value.path == folder / ".lock"
        assert str(e.value).endswith("no lock was taken. Make the folder writable, then try again")
    out = moelab_cli("run", "tiny", *SMALL_CLI, "--steps", "1", "--out", disk / "new")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"moelab: {e.value}"  # one line, as any folder write
    tmpfs.read_only(disk, on=False)
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)  # the disk full to its last byte
    for size in (4096, 1):
        try:
            while os.write(fd, b"x" * size) == size:
                pass
        except OSError:
            pass
    os.close(fd)
    with pytest.raises(FolderWriteError, match="disk full") as e:
        lock_folder(disk / "old", "inline")
    assert e.value.path == disk / "old" / ".lock" and not folder_module._HELD
    (disk / "filler").unlink()
    holder = _holder(disk / "old")  # another process takes it: nothing was left held here
    holder.kill()
    holder.wait()


def test_a_second_thread_of_the_owning_process_is_refused_and_the_run_stays_completed(tmp_path):
    """Issue 42.11: two threads of one process submitting to one folder. The lock is re-entrant only in the thread
    that took it (its inline run takes it again as rank 0); the second thread is refused like a second process,
    writes nothing, and the first run ends COMPLETED."""
    import threading

    from moelab import Session
    from moelab.contract.stream import read_events
    from moelab.run.run import Run

    folder = tmp_path / "run"
    small = {"model": {"num_layers": 2, "hidden_size": 32, "moe": {"num_experts": 4, "expert_ffn_size": 32}},
             "train": {"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu",
                       "warmup_steps": 1, "steps": 40, "save_checkpoints": False}}
    session = Session("tiny", **small)
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(run=session.submit("inline", folder=folder)))
    t.start()
    deadline = time.monotonic() + 120
    while not any(e["event"] == "step" for e in read_events(folder / "metrics.jsonl", live=True)
                  if (folder / "metrics.jsonl").exists()):
        assert time.monotonic() < deadline and t.is_alive(), "the first run never stepped"
        time.sleep(0.05)
    with pytest.raises(FolderLocked, match="another thread of this process") as e:
        session.submit("inline", folder=folder)
    assert "moelab cancel" not in str(e.value)
    t.join()
    assert first["run"].status == "COMPLETED" and Run.load(folder).status == "COMPLETED"
    assert sum(e["event"] == "start" for e in read_events(folder / "metrics.jsonl")) == 1
    assert folder_module._HELD == {}


INLINE_HOLD = ("import sys, time, json, os, socket\nfrom moelab.contract.folder import lock_folder, RunFolder\n"
               "l = lock_folder(sys.argv[1], 'rank 0')\nRunFolder(sys.argv[1]).write_info({'executor': 'inline', "
               "'status': 'RUNNING', 'pid': os.getpid(), 'host': socket.gethostname()})\nprint('held', flush=True)\n"
               "time.sleep(600)\n")


def test_a_refusal_for_a_folder_of_an_inline_run_says_what_stops_it(tmp_path):
    """Issue 42.13: `moelab cancel` cannot stop an inline run; the refusal says what does (Ctrl-C in its process)."""
    p = subprocess.Popen([sys.executable, "-c", INLINE_HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(FolderLocked) as e:
            lock_folder(tmp_path / "run", "submit")
        assert "moelab cancel" not in str(e.value) and f"kill -INT {p.pid}" in str(e.value)
        cli = moelab_cli("run", "tiny", *SMALL_CLI, "--steps", 1, "--out", tmp_path / "run")
        assert cli.returncode == 2 and "moelab cancel" not in cli.stderr and "Ctrl-C" in cli.stderr, cli.stderr
    finally:
        p.kill()
        p.wait()
