"""The run folder: the one contract between whoever writes a run and whoever reads it.

A run is a folder on a shared file system. The trainer writes the config it ran, the metrics stream, the
summary and the checkpoints; the launcher writes run.json (how to find the job again from another kernel) and
links to every rank's logs; Run, the live view, the plots and `moelab status` only read. Every file name lives
here, and every write of a JSON file goes through `write_json` (atomic: a reader never sees half a file).

    folder = RunFolder("runs/tiny-20261130-101500")
    folder.config, folder.metrics, folder.summary        # Path objects: config.yaml, metrics.jsonl, summary.json
    folder.read_info()                                   # run.json as a dict ({} when there is none)
    folder.update_info(status="CANCELLED")               # read, change, write back atomically
    folder.rank_log(0, "err")                            # logs/rank0.err

Standard library only, so every layer (train, launch, run, live) can stand on it. The read-modify-write of
run.json has one place, `update_info`, which is where a lock on the folder goes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"       # the config the run trains (written before any rank starts)
METRICS = "metrics.jsonl"    # the event stream (moelab.train.metrics)
SUMMARY = "summary.json"     # written by rank 0 at the end
INFO = "run.json"            # executor, job id, submitit folder, options, final status (written by launch)
SWEEP = "sweep.json"         # a sweep folder's grid and runs
CHECKPOINTS = "checkpoints"  # one folder per saved step
LOGS = "logs"                # rank<r>.out / rank<r>.err (files, or links to the executor's files)
SUBMITIT = "submitit"        # the submitit executor's folder of a Session run


def read_json(path: "str | Path") -> Any:
    """The parsed file, or None when it is missing or not (yet) valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: "str | Path", data: Any) -> None:
    """Write atomically (another kernel may be reading it): a temporary file, then os.replace."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class RunFolder:
    """The files of one run folder, by name. Creating one touches nothing on disk.

        f = RunFolder("runs/tiny")
        f.holds_run()          # False for a fresh folder
        f.write_info({"executor": "inline", "status": "RUNNING"})
    """

    def __init__(self, path: "str | Path"):
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def info_path(self) -> Path:
        return self.path / INFO

    @property
    def sweep_path(self) -> Path:
        return self.path / SWEEP

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    @property
    def submitit(self) -> Path:
        return self.path / SUBMITIT

    def rank_log(self, rank: int, suffix: str) -> Path:
        """logs/rank<rank>.<suffix>, suffix "out" or "err"."""
        return self.logs / f"rank{rank}.{suffix}"

    # ------------------------------------------------------------------ what is there
    def is_run(self) -> bool:
        """Anything a run leaves: run.json, metrics.jsonl or config.yaml."""
        return any(p.exists() for p in (self.info_path, self.metrics, self.config))

    def holds_run(self) -> bool:
        """A run was started here (run.json or a metrics stream): a new run must not reuse the folder."""
        return self.info_path.exists() or self.metrics.exists()

    def is_sweep(self) -> bool:
        return self.sweep_path.exists()

    # ------------------------------------------------------------------ run.json
    def read_info(self) -> dict:
        """run.json ({} when the run was started without a Session, e.g. by torchrun or an sbatch script)."""
        return read_json(self.info_path) or {}

    def write_info(self, info: dict) -> None:
        write_json(self.info_path, info)

    def update_info(self, **fields: Any) -> dict:
        """Merge `fields` into run.json and return the new info (read, change, write back atomically)."""
        info = {**self.read_info(), **fields}
        self.write_info(info)
        return info

    def read_summary(self) -> dict | None:
        return read_json(self.summary)

    def created(self) -> float:
        """When the run was created (run.json), else when its config was written; 0 if neither is known."""
        info = self.read_info()
        if "created" in info:
            return float(info["created"])
        try:
            return self.config.stat().st_mtime
        except OSError:
            return 0.0
