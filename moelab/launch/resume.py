"""Continue a run from its last checkpoint: what `moelab resume FOLDER` and `Run.resume()` call.

A run folder knows everything needed to continue: config.yaml (the config), checkpoints/ (the state) and
metrics.jsonl (the stream, rewound to the checkpoint so no step is duplicated or missing). The trainer itself
restores the newest intact checkpoint at setup, so resuming is simply training the folder's config again, on
as many ranks as before unless told otherwise (any layout can load any other's checkpoint).

    summary = resume("runs/tiny")               # in this process, or on the run's former number of processes
    summary = resume("runs/tiny", steps=200)    # and train longer than first planned
"""
from __future__ import annotations

from pathlib import Path

from moelab.config import ConfigError, load_config
from moelab.train.metrics import MetricsError, read_events


def resume_config(run_dir: "str | Path", steps: int | None = None):
    """The folder's config (with train.steps changed if `steps`); ConfigError if it is not a run folder."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir}: not a run folder (no config.yaml); give the folder a run was started in")
    return load_config(run_dir / "config.yaml", {"train.steps": steps} if steps is not None else None)


def previous_world_size(run_dir: "str | Path") -> int:
    """How many ranks the run last trained on (its last `start` event; 1 if unknown)."""
    try:
        starts = [e for e in read_events(Path(run_dir) / "metrics.jsonl", live=True) if e["event"] == "start"]
    except MetricsError:
        return 1
    return int(starts[-1].get("env", {}).get("world_size") or 1) if starts else 1


def resume(run_dir: "str | Path", steps: int | None = None, nproc: int | None = None,
           progress: bool = False) -> dict:
    """Continue the run in `run_dir` from its newest intact checkpoint (from step 0 if it has none) until
    train.steps; returns the summary. `nproc` local processes (default: as many as the run had)."""
    run_dir = Path(run_dir)
    cfg = resume_config(run_dir, steps)
    nproc = nproc or previous_world_size(run_dir)
    if nproc > 1:
        from moelab.launch.local import run_local_processes

        return run_local_processes(cfg, run_dir, nproc)
    from moelab.train.trainer import Trainer

    return Trainer(cfg, run_dir, progress=progress).run()

