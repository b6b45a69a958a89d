"""Send prepared run folders to an executor and return their Jobs (Session.submit and Session.sweep end here).

    kind, world = validate("slurm", 1, {"time": 30}, [cfg_a, cfg_b])   # every check before anything is sent
    jobs = submit_folders(kind, [folder_a, folder_b], nproc=1, options={"time": 30}, submitit_folder=root,
                          world=world)                                 # two folders -> one SLURM job array

Each folder already holds its config.yaml (prepare_folder). The executor (moelab.launch.executors) writes run.json
(what a Run needs to find the job again from another kernel) and, for submitit's, logs/ links to every rank's
stdout and stderr. The layout of every config is checked by the one validator before anything is submitted.
"""
from __future__ import annotations

from pathlib import Path

from moelab.config import ConfigError, load_config, save_config
from moelab.launch.executors import get_executor, parse_time_s
from moelab.launch.jobs import Job
from moelab.train.preflight import preflight
from moelab.contract.folder import RunFolder


def validate(executor: str, nproc: int, options: dict, configs: list) -> tuple[str, int]:
    """Ask the executor to check its options and the request (moelab.launch.executor), and check every config's
    preflight (moelab.train.preflight) for the world size, BEFORE anything is submitted; returns (executor
    without 'auto', world size)."""
    ex = get_executor(executor)
    ex.check_options(options)
    if "time" in options:
        parse_time_s(options["time"])
    world = ex.world_size(nproc, options)
    ex.check_request(nproc, options)
    for cfg in configs:  # layout, packages, data, init checkpoint: moelab.train.preflight
        preflight(cfg, world, ex.name)
    return ex.name, world


def prepare_folder(folder: "str | Path", cfg) -> RunFolder:
    """Create a fresh run folder holding config.yaml; refuses a folder that already holds a run."""
    folder = RunFolder(folder)
    if folder.holds_run():  # the re-run rule (moelab.launch.rerun): refused, the folder untouched
        from moelab.launch.rerun import rerun_refusal

        raise ConfigError(rerun_refusal(folder, cfg))
    folder.path.mkdir(parents=True, exist_ok=True)
    save_config(cfg, folder.config)
    load_config(folder.config)  # what the job will read must load
    return folder


def submit_folders(kind: str, folders: list, nproc: int, options: dict, submitit_folder: "str | Path",
                   world: int) -> list[Job]:
    """Hand prepared folders to the executor `kind` (already resolved); one Job per folder."""
    folders = [f if isinstance(f, RunFolder) else RunFolder(f) for f in folders]
    return get_executor(kind).submit(folders, nproc, options, submitit_folder, world)


def unlink_logs(folder: RunFolder) -> None:
    """Drop the logs/ links of a previous job (before the folder is submitted again)."""
    for link in folder.logs.glob("rank*"):
        if link.is_symlink():
            link.unlink()
