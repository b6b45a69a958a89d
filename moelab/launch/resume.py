"""Continue a run from its last checkpoint: what `moelab resume FOLDER` and `Run.resume()` both call.

A run folder knows everything needed to continue: config.yaml (the config), checkpoints/ (the state), run.json
(the executor and its options) and metrics.jsonl (the stream, rewound to the checkpoint so no step is
duplicated or missing). The trainer itself restores the newest intact checkpoint at setup, so resuming is
training the folder's config again: on the same executor with the same options (those given replace them),
on as many ranks as before unless told otherwise (any layout can load any other's checkpoint).

    job = resume("runs/tiny")                 # a Job (moelab.launch.jobs); inline runs have finished already
    job = resume("runs/tiny", steps=200)      # and train longer than first planned
    summary = job.wait().summary()
"""
from __future__ import annotations

import sys
from pathlib import Path

from moelab.config import ConfigError, load_config, save_config
from moelab.launch.executors import EXECUTORS, job_for
from moelab.launch.jobs import Job
from moelab.contract.folder import RunFolder
from moelab.contract.stream import MetricsError, tail_events
from moelab.launch.claim import claim_folder


def resume_config(run_dir: "str | Path", steps: int | None = None):
    """The folder's config (with train.steps changed if `steps`); ConfigError if it is not a run folder."""
    folder = RunFolder(run_dir)
    if not folder.config.is_file():
        raise ConfigError(f"{folder.path}: not a run folder (no config.yaml); give the folder a run was started in")
    return load_config(folder.config, {"train.steps": steps} if steps is not None else None)


def previous_world_size(run_dir: "str | Path") -> int:
    """How many ranks the run last trained on (its last `start` event; 1 if unknown)."""
    last, first = tail_events(RunFolder(run_dir).metrics, kinds=("start",))
    starts = last or first
    return int((starts[-1].env.world_size if starts[-1].env else None) or 1) if starts else 1


def resume(run_dir: "str | Path", steps: int | None = None, nproc: int | None = None, **cluster_options) -> Job:
    """Continue the run in `run_dir` from its newest intact checkpoint (from step 0 if it has none) until
    train.steps. A run whose executor trains in the background (local, SLURM) goes back to it with its options
    (`cluster_options` replace them); a run trained in the foreground (inline, or started without a Session)
    continues in this process, or on `nproc` local processes (default: as many as it had) through the local
    executor. A folder that cannot be continued in this process raises (ConfigError, CheckpointError,
    MetricsError)."""
    from moelab.contract.checkpoints import CheckpointError
    from moelab.launch.inline import run_inline
    from moelab.launch.submit import submit_folders, unlink_logs, validate

    from moelab.launch.rerun import extension_note, reached_step, resume_point

    folder = RunFolder(run_dir)
    resume_config(folder.path)  # not a run folder: refused before the claim creates anything
    with claim_folder(folder):  # FolderLocked while a job of the run is pending or running (moelab.launch.claim)
        # every check that can refuse, before the first write: a refusal leaves the folder as it was
        cfg = resume_config(folder.path, steps)
        reached = reached_step(folder)
        start, behind = resume_point(folder)  # the newest intact checkpoint's step, not the stream's last
        note = extension_note(resume_config(folder.path), cfg, start)  # refuses steps below the checkpoint's
        if reached >= cfg.train.steps and job_for(folder).state() == "COMPLETED":
            raise ConfigError(f"{folder.path}: the run is already COMPLETED at step {reached}/{cfg.train.steps}; "
                              f"nothing to resume (give --steps M / resume(steps=M) to train further)")
        check_resumable(folder)
        info = folder.read_info()
        executor = EXECUTORS.get(info.get("executor"))
        here = False
        if executor is not None and executor.in_background:  # back to its executor, with its options
            options = {**info.get("options", {}), **cluster_options}
            nproc = nproc or executor.resume_nproc(info, options)
            kind = executor.name
        else:  # it trained in the foreground: here for one rank, else on local processes
            options = dict(cluster_options)
            nproc = nproc or previous_world_size(folder.path)
            here = nproc == 1 and not options
            kind = "inline" if here else "local"
        kind, world = validate(kind, nproc, options, [cfg])
        for line in (behind, note):
            if line:
                print(f"moelab: {line}", file=sys.stderr)
        if steps is not None:
            save_config(cfg, folder.config)  # what the ranks read
        unlink_logs(folder)  # they point at the previous job's files
        if here:
            return run_inline(folder, reraise=(ConfigError, CheckpointError, MetricsError))
        root = Path(info.get("submitit_folder") or folder.submitit)
        return submit_folders(kind, [folder], nproc, options, root, world)[0]


def check_resumable(folder: RunFolder) -> None:
    """CheckpointError when the folder has checkpoints and none is intact: the ranks would refuse at restore
    (moelab.train.checkpoint.Checkpointer.restore), after the resume had rewritten the folder."""
    from moelab.contract.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints, verify

    found = list_checkpoints(folder.path)
    if found and latest_checkpoint(folder.path) is None:
        problems = " | ".join(f"{p.name}: {'; '.join(verify(p))}" for p in reversed(found))
        raise CheckpointError(f"{folder.checkpoints}: no usable checkpoint ({problems}); nothing was changed. Move "
                              f"the checkpoints folder away to train again from step 0")
