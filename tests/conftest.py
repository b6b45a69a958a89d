"""Fixtures shared by several test folders: a REAL local SLURM cluster (slurm/local/start.sh), never a mock, and
real small disks (tmpfs) that fill up or are read-only.

The cluster is started once per test session when `sinfo` does not answer (tests/launch and the SLURM notebook
in tests/live use it). SLURM tests are skipped only where the script cannot run (not root, or not
Debian/Ubuntu); anywhere else a failing start is an error.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# warm rank processes (moelab.launch.warm) started by the tests, their subprocesses included, leave soon after
os.environ.setdefault("MOELAB_WARM_IDLE_S", "120")


@pytest.fixture(scope="session", autouse=True)
def stop_warm_server():
    """The warm rank process that this test session's local submits started stops with the session."""
    yield
    from moelab.launch import warm

    warm.stop()


def _cluster_answers() -> bool:
    if not shutil.which("sinfo"):
        return False
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return r.returncode == 0 and any(s in r.stdout for s in ("idle", "mixed", "allocated"))


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running single-node SLURM cluster with accounting."""
    if _cluster_answers():
        return
    if os.geteuid() != 0 or not Path("/etc/debian_version").exists():
        pytest.skip("the local SLURM cluster needs root on Debian/Ubuntu (slurm/local/start.sh)")
    r = subprocess.run(["bash", str(REPO / "slurm/local/start.sh")], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"slurm/local/start.sh failed:\n{r.stdout}\n{r.stderr}"
    assert _cluster_answers(), "slurm/local/start.sh finished but sinfo shows no usable node"


class Tmpfs:
    """Mounts small tmpfs disks under a test's folder: `tmpfs(size)` -> a fresh one of `size` bytes (a real disk
    that fills up); `tmpfs.read_only(where)` remounts it read-only (`on=False`: writable again)."""

    def __init__(self, root: Path):
        self.root, self.mounts = root, []

    def __call__(self, size: int) -> Path:
        where = self.root / f"mnt{len(self.mounts)}"
        where.mkdir()
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
        if out.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
        self.mounts.append(where)
        return where

    def read_only(self, where: Path, on: bool = True) -> None:
        out = subprocess.run(["mount", "-o", f"remount,{'ro' if on else 'rw'}", str(where)], capture_output=True,
                             text=True)
        if out.returncode:
            pytest.skip(f"cannot remount read-only: {out.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path):
    """A Tmpfs (mounting needs root, as the CI machine runs tests; skipped without); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a real full or read-only disk) needs root")
    disks = Tmpfs(tmp_path)
    yield disks
    for where in disks.mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)
