"""Session: a config you are about to run, and the verbs that send it somewhere.

    from moelab import Session
    s = Session("tiny", train={"steps": 50}, parallel={"ep": 2})
    s = s.set("model.moe.num_experts", 16)         # a new Session; the old one is unchanged
    s.plan(gpus=8)                                 # analytic estimate (moelab.planner.plan)
    run = s.submit("local", nproc=2)               # -> moelab.Run; "inline", "local", "slurm" or "auto"
    sweep = s.sweep({"model.moe.aux_loss_coeff": [0, 1e-3, 1e-2]}, executor="slurm", time=30)

A Session is immutable: every change returns a new one, so a notebook cell can branch from it safely.
"""
from __future__ import annotations

import contextlib
import itertools
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from moelab.config import Config, ConfigError, flatten, load_config
from moelab.config.paths import RUN_FOLDER_FIX, check_path
from moelab.launch import warm


def _hf_source(spec: str) -> dict:
    from moelab.hf.source import config_dict

    return config_dict(spec)


# Sources the config layer cannot read itself: `hf:PATH` (a Hugging Face checkpoint; moelab.hf.source), also as
# a YAML file's `base: hf:PATH`. Session and the CLI pass these to moelab.config.load_config.
SOURCE_READERS = {"hf": _hf_source}


class Session:
    """A validated Config plus submit/sweep. `source` is a preset name, a YAML path, `hf:PATH` (a Hugging Face
    checkpoint folder: its config, and its weights to start from), a dict or a Config; keyword sections are
    nested dicts of overrides (`train={"steps": 20}`) or top-level values (`name=`).

        run = Session("tiny", train={"steps": 20}).set("parallel.ep", 2).submit("local", nproc=2)
    """

    def __init__(self, source: "str | Path | dict | Config" = "tiny", /, **sections: Any):
        self._config = load_config(source, flatten(sections), readers=SOURCE_READERS)
        if "ipykernel" in sys.modules:  # in a notebook, have a warm rank process ready for the first local submit
            warm.start()

    @property
    def config(self) -> Config:
        """The Config this Session submits."""
        return self._config

    def set(self, key: "str | dict", value: Any = None) -> "Session":
        """A new Session with dotted overrides: ``s.set("train.steps", 20)`` or ``s.set({"train.steps": 20})``."""
        overrides = dict(key) if isinstance(key, dict) else {key: value}
        return Session(load_config(self._config, overrides))

    def plan(self, gpus: int | None = None, **kwargs: Any):
        """Parameters, activated parameters, FLOPs per token and memory per GPU for this config, and with
        gpu="h100" | "h200" the predicted step time (moelab.planner.plan.plan, which takes the keywords; an HTML
        table in a notebook, text elsewhere)."""
        from moelab.planner.plan import plan

        return plan(self._config, gpus=gpus, **kwargs)

    def submit(self, executor: str = "local", nproc: int = 1, folder: "str | Path | None" = None,
               **cluster_options: Any):
        """Start this config and return its Run at once (inline: after it has finished).

        executor: "inline" (this process, blocking), "local" (submitit's LocalExecutor: background
        processes on this machine, no SLURM needed), "slurm" (sbatch through submitit) or "auto" (slurm where
        sbatch is on PATH, else local). nproc: ranks on this machine (local; for slurm give gpus_per_node and
        nodes). folder: the run folder (default runs/<name>-<time>). cluster_options: see
        moelab.launch.executors (time, partition, gpus_per_node, nodes, mem, account, qos, setup, sbatch=...).
        The layout is checked against the world size before anything is submitted.
        """
        from moelab.launch.submit import prepare_folder, submit_folders, validate
        from moelab.run.run import Run

        from moelab.launch.claim import claim_folder

        kind, world = validate(executor, nproc, cluster_options, [self._config])
        path = check_path("folder", folder or _default_folder(self._config.name), "folder to write", RUN_FOLDER_FIX)
        existed = path.exists()
        with claim_folder(path):  # the lock first (moelab.launch.claim); a folder holding a run is refused
            folder = prepare_folder(path, self._config)
            try:
                job = submit_folders(kind, [folder], nproc, cluster_options, folder.submitit, world)[0]
            except Exception:
                if not existed and not folder.holds_run():  # a failed sbatch leaves no orphan run folder
                    shutil.rmtree(path, ignore_errors=True)
                raise
        return Run(folder.path, job.info, job)

    def sweep(self, grid: dict, executor: str = "local", nproc: int = 1, folder: "str | Path | None" = None,
              **cluster_options: Any):
        """One run per point of the grid (the cartesian product of the value lists), returned as a Sweep.
        On SLURM the runs go out as ONE job array (submitit's executor.batch()); locally they run side by side.

            s.sweep({"model.moe.aux_loss_coeff": [0, 1e-3], "model.moe.top_k": [1, 2]})   # 4 runs
        """
        from moelab.launch.submit import prepare_folder, submit_folders, validate
        from moelab.contract.folder import RunFolder, write_json
        from moelab.launch.claim import claim_folder
        from moelab.run.run import Run
        from moelab.run.sweep import Sweep

        if not isinstance(grid, dict) or not grid:
            raise ConfigError(f"sweep grid={grid!r}: give a dict of dotted keys to lists of values, e.g. "
                              f"{{'model.moe.aux_loss_coeff': [0, 1e-3, 1e-2]}}")
        keys = list(grid)
        for k in keys:
            if not isinstance(grid[k], (list, tuple)) or not grid[k]:
                raise ConfigError(f"sweep grid[{k!r}]={grid[k]!r}: give a non-empty list of values")
        points = [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]
        configs = [load_config(self._config, p) for p in points]  # every point is validated before any submit
        kind, world = validate(executor, nproc, cluster_options, configs)
        root = check_path("folder", folder or _default_folder(f"{self._config.name}-sweep"), "folder to write",
                          RUN_FOLDER_FIX)
        if RunFolder(root).is_sweep():
            raise ConfigError(f"folder={str(root)!r} already holds a sweep; choose a new folder")
        root.mkdir(parents=True, exist_ok=True)
        names = [f"{i:02d}-" + ",".join(f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in p.items())
                 for i, p in enumerate(points)]
        with contextlib.ExitStack() as locks:
            for n in names:
                locks.enter_context(claim_folder(root / n))
            folders = [prepare_folder(root / n, cfg) for n, cfg in zip(names, configs)]
            write_json(RunFolder(root).sweep_path, {"grid": {k: list(v) for k, v in grid.items()}, "points": points,
                                                           "runs": names, "executor": kind, "created": time.time()})
            jobs = submit_folders(kind, folders, nproc, cluster_options, RunFolder(root).submitit, world)
        return Sweep([Run(job.folder.path, job.info, job) for job in jobs], root)

    def __repr__(self) -> str:
        c = self._config
        m = c.model
        return (f"Session({c.name!r}: {m.num_layers} layers, hidden {m.hidden_size}, {m.moe.num_experts} experts "
                f"top-{m.moe.top_k}, {c.train.steps} steps, parallel ep={c.parallel.ep} pp={c.parallel.pp} "
                f"cp={c.parallel.cp} fsdp={c.parallel.fsdp})")


def _default_folder(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def _short(v: Any) -> str:
    return (f"{v:g}" if isinstance(v, float) else str(v)).replace("/", "_").replace(" ", "")
