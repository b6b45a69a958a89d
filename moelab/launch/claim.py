"""The one rule for every path that starts training in a run folder (Session.submit, `moelab run`, resume,
fork): claim the folder first, then check, then write.

Claiming takes the folder's writer lock (moelab.contract.folder.lock_folder) before anything is written or
submitted, and refuses while the run recorded there still has a live owner: its job pending or running, which
may not hold the lock yet (a local or SLURM job's rank 0 takes it only once it has started up, seconds to hours
after run.json was written). Every check that can refuse runs while the folder is claimed and before the first
write, so a refusal leaves the folder byte-identical and its status unchanged.

    with claim_folder("runs/tiny") as folder:      # FolderLocked while a job of the run is pending or running
        ... check everything (may raise: nothing written yet) ...
        ... write config.yaml / run.json, submit ...
"""
from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from moelab.contract.folder import FolderLocked, RunFolder, lock_folder


def live_owner(folder: RunFolder) -> tuple[dict, str] | None:
    """(owner, why) when the job run.json names is still pending or running, else None."""
    from moelab.launch.executors import job_for
    from moelab.launch.jobs import TERMINAL

    if not folder.info_path.exists():
        return None
    job = job_for(folder)
    state = job.state()
    if state in TERMINAL:
        return None
    info = job.info
    owner = {"pid": job.owner_pid,
             "host": info.get("host", socket.gethostname()), "job_id": info.get("job_id"),
             "since": info.get("created", 0),
             "role": f"{job.executor} job, {state}"}
    cancel = f"`moelab cancel {folder.path}`" if job.cancellable else "Ctrl-C in the process that runs it"
    return owner, f"its job is {state}: wait for it to end (`moelab status {folder.path}`) or cancel it ({cancel})"


@contextlib.contextmanager
def claim_folder(folder: "str | Path | RunFolder", role: str = "submit"):
    """Hold `folder`'s writer lock for the block, refusing (FolderLocked) a folder whose run has a live owner;
    yields the RunFolder. See the module docstring for the rule."""
    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    with lock_folder(folder.path, role):
        live = live_owner(folder)
        if live is not None:
            raise FolderLocked(folder.path, *live)
        yield folder
