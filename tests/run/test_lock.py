"""The run folder's writer lock (moelab.run.folder.FolderLock), with real processes: a second writer is refused
naming the owner, the lock of a killed owner is taken over, and re-entry in one process is allowed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from moelab.run.folder import FolderLocked, lock_folder, read_owner

HOLD = ("import sys, time\nfrom moelab.run.folder import lock_folder\nlock_folder(sys.argv[1], 'test holder')\n"
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
    code = ("import sys, time\nfrom moelab.run.folder import lock_folder\nl = lock_folder(sys.argv[1], 'submit')\n"
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
