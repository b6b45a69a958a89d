"""Send prepared run folders to an executor and return their Runs (Session.submit and Session.sweep end here).

    runs = submit_folders("slurm", [folder_a, folder_b], nproc=1, options={"time": 30}, submitit_folder=root)
    # two folders -> one SLURM job array (submitit's executor.batch())

Each folder already holds its config.yaml. This module writes run.json (what Run.load needs to find the job
again from another kernel) and logs/ links to every rank's stdout and stderr.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from moelab.config import ConfigError, check_layout, load_config
from moelab.launch.executors import (TrainJob, check_options, make_executor, parse_time_s, resolve_executor,
                                     world_size)
from moelab.run import RUN_FILE, Run, write_json


def validate(executor: str, nproc: int, options: dict, configs: list) -> tuple[str, int]:
    """Check executor, options and every config's layout for the world size BEFORE anything is submitted;
    returns (executor without 'auto', world size)."""
    kind = resolve_executor(executor)
    check_options(kind, options)
    if "time" in options:
        parse_time_s(options["time"])
    world = world_size(kind, nproc, options)
    if kind == "slurm":  # issue 21: a request the partition can never meet is refused here, not left pending
        from moelab.launch.executors import tasks_per_node
        from moelab.launch.slurm_checks import check_request
        check_request({**options, "tasks_per_node": tasks_per_node(nproc, options)}, options.get("partition"))
    for cfg in configs:
        try:
            check_layout(cfg, world)
        except ConfigError as e:
            raise ConfigError(f"{e} (config {cfg.name!r} on {world} rank(s) = executor={kind!r}, nproc/nodes/"
                              f"gpus_per_node as given)") from None
    return kind, world


def submit_folders(kind: str, folders: list[Path], nproc: int, options: dict, submitit_folder: Path,
                   world: int) -> list[Run]:
    """Submit one TrainJob per folder (several = one job array on SLURM); `kind` is already resolved."""
    if kind == "inline":
        return [run_inline(f) for f in folders]
    ex = make_executor(kind, submitit_folder, nproc, options)
    jobs = []
    if len(folders) == 1:
        jobs.append(ex.submit(TrainJob(folders[0])))
    else:
        with ex.batch():
            for f in folders:
                jobs.append(ex.submit(TrainJob(f)))
    time_s = parse_time_s(options["time"]) if "time" in options else None
    out = []
    for folder, job in zip(folders, jobs):
        array_id = str(job.job_id).split("_")[0] if "_" in str(job.job_id) else None
        info = {"name": folder.name, "executor": kind, "created": time.time(), "job_id": str(job.job_id),
                "array_job_id": array_id, "submitit_folder": str(Path(submitit_folder).resolve()),
                "ntasks": world, "time_limit_s": time_s, "options": _jsonable(options)}
        write_json(folder / RUN_FILE, info)
        run = Run(folder, info, job)
        _link_logs(run, world)
        out.append(run)
    return out


def run_inline(folder: Path) -> Run:
    """Train in this process (blocking) and return the finished Run. A failure is recorded, not raised
    (status FAILED, the traceback in .error); Ctrl-C records CANCELLED and is re-raised."""
    from moelab.launch.entry import train_rank

    info = {"name": folder.name, "executor": "inline", "created": time.time(), "status": "RUNNING",
            "ntasks": 1, "pid": os.getpid()}
    write_json(folder / RUN_FILE, info)
    run = Run(folder, info)
    try:
        status = train_rank(folder, progress=True)["status"]  # COMPLETED, or PREEMPTED by a signal
    except KeyboardInterrupt:
        run._update_info(status="CANCELLED")
        raise
    except Exception:  # noqa: BLE001 - the trainer wrote the error event; .error shows it
        status = "FAILED"
    run._update_info(status=status)
    return run


def _link_logs(run: Run, world: int) -> None:
    """logs/rank<k>.out and .err -> submitit's files, so a user finds them from the run folder."""
    logs = run.folder / "logs"
    logs.mkdir(exist_ok=True)
    for rank in range(world):
        paths = run._paths(rank)
        for suffix, target in (("out", paths.stdout), ("err", paths.stderr)):
            link = logs / f"rank{rank}.{suffix}"
            if not link.is_symlink() and not link.exists():
                link.symlink_to(os.path.relpath(target, logs))


def _jsonable(options: dict) -> dict:
    return {k: v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)
            for k, v in options.items()}


def prepare_folder(folder: Path, cfg) -> Path:
    """Create a fresh run folder holding config.yaml; refuses a folder that already holds a run."""
    from moelab.config import save_config

    folder = Path(folder)
    if (folder / RUN_FILE).exists() or (folder / "metrics.jsonl").exists():
        raise ConfigError(f"folder={str(folder)!r} already holds a run; choose a new folder (or load it with "
                          f"moelab.Run.load)")
    folder.mkdir(parents=True, exist_ok=True)
    save_config(cfg, folder / "config.yaml")
    load_config(folder / "config.yaml")  # what the job will read must load
    return folder
