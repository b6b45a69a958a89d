"""Send prepared run folders to an executor and return their Jobs (Session.submit and Session.sweep end here).

    jobs = submit_folders("slurm", [folder_a, folder_b], nproc=1, options={"time": 30}, submitit_folder=root)
    # two folders -> one SLURM job array (submitit's executor.batch())

Each folder already holds its config.yaml (prepare_folder). This module writes run.json (what a Run needs to
find the job again from another kernel) and logs/ links to every rank's stdout and stderr, through
moelab.contract.folder. The layout of every config is checked by the one validator before anything is submitted.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from moelab.config import ConfigError, load_config, save_config
from moelab.launch.executors import (TrainJob, check_options, make_executor, parse_time_s, resolve_executor,
                                     world_size)
from moelab.launch.jobs import InlineJob, Job, job_for
from moelab.train.preflight import preflight
from moelab.contract.folder import RunFolder


def validate(executor: str, nproc: int, options: dict, configs: list) -> tuple[str, int]:
    """Check executor and options, and every config's preflight (moelab.train.preflight) for the world size,
    BEFORE anything is submitted; returns (executor without 'auto', world size)."""
    kind = resolve_executor(executor)
    check_options(kind, options)
    if "time" in options:
        parse_time_s(options["time"])
    world = world_size(kind, nproc, options)
    if kind == "slurm":  # issue 21: a request the partition can never meet is refused here, not left pending
        from moelab.launch.executors import tasks_per_node
        from moelab.launch.slurm_checks import check_request
        check_request({**options, "tasks_per_node": tasks_per_node(nproc, options)}, options.get("partition"))
    for cfg in configs:  # layout, packages, data, init checkpoint: moelab.train.preflight
        preflight(cfg, world, kind)
    return kind, world


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
    """Submit one TrainJob per folder (several = one job array on SLURM); `kind` is already resolved."""
    folders = [f if isinstance(f, RunFolder) else RunFolder(f) for f in folders]
    if kind == "inline":
        return [run_inline(f) for f in folders]
    ex = make_executor(kind, Path(submitit_folder), nproc, options)
    handles = []
    if len(folders) == 1:
        handles.append(ex.submit(TrainJob(folders[0].path)))
    else:
        with ex.batch():
            for f in folders:
                handles.append(ex.submit(TrainJob(f.path)))
    time_s = parse_time_s(options["time"]) if "time" in options else None
    jobs = []
    for folder, handle in zip(folders, handles):
        array_id = str(handle.job_id).split("_")[0] if "_" in str(handle.job_id) else None
        info = {"name": folder.name, "executor": kind, "created": time.time(), "job_id": str(handle.job_id),
                "array_job_id": array_id, "submitit_folder": str(Path(submitit_folder).resolve()),
                "ntasks": world, "time_limit_s": time_s, "options": _jsonable(options)}
        folder.write_info(info)
        job = job_for(folder, info, handle)
        _link_logs(job, world)
        jobs.append(job)
    return jobs


def run_inline(folder: "RunFolder | str | Path", reraise: tuple = (ConfigError,)) -> InlineJob:
    """Train in this process (blocking) and return the finished job. A failure is recorded, not raised
    (status FAILED, the traceback in the stream), except the `reraise` kinds (bad input found at setup: a
    ConfigError such as a missing backend package), which are recorded and raised; Ctrl-C records CANCELLED
    and is re-raised."""
    from moelab.launch.entry import train_rank

    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    info = {"name": folder.name, "executor": "inline", "created": time.time(), "status": "RUNNING",
            "ntasks": 1, "pid": os.getpid(), "host": socket.gethostname()}
    folder.write_info(info)
    with tee_output(folder) as err:
        try:
            status = train_rank(folder.path, progress=True)["status"]  # COMPLETED, or PREEMPTED by a signal
        except KeyboardInterrupt:
            folder.update_info(status="CANCELLED")
            raise
        except reraise:
            folder.update_info(status="FAILED")
            raise
        except Exception:  # noqa: BLE001 - the trainer wrote the error event; Run.error shows it
            traceback.print_exc(file=err)  # the log keeps the traceback the stream's error event holds
            status = "FAILED"
    return InlineJob(folder, folder.update_info(status=status))


class Tee:
    """A text stream that writes to `stream` (the notebook cell, the terminal) and, for a thread that trains an
    inline run (tee_output registers it in `files`), to that run's log file as well; every other attribute is
    the stream's. One Tee serves every inline run of the process, so runs in threads neither mix their logs nor
    leave a closed file behind.

        sys.stdout = Tee(sys.stdout); sys.stdout.files[threading.get_ident()] = open("logs/rank0.out", "a")
    """

    def __init__(self, stream):
        self.stream = stream
        self.files: dict = {}  # thread ident -> the log file of the run that thread trains

    def write(self, text: str) -> int:
        file = self.files.get(threading.get_ident())
        if file is not None:
            file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        file = self.files.get(threading.get_ident())
        if file is not None:
            file.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


_TEES = threading.Lock()  # guards installing, registering in and removing the Tees of sys.stdout / sys.stderr


@contextlib.contextmanager
def tee_output(folder: RunFolder):
    """While an inline run trains, what its thread prints (the progress bar, warnings) goes to the cell or
    terminal as before and to logs/rank0.out / rank0.err, as the other executors' ranks write theirs (a resumed
    run appends); yields the stderr log file. The last run to end puts the original streams back."""
    folder.logs.mkdir(parents=True, exist_ok=True)
    with open(folder.rank_log(0, "out"), "a", buffering=1) as out, open(folder.rank_log(0, "err"), "a",
                                                                         buffering=1) as err:
        me, tees = threading.get_ident(), {}
        with _TEES:
            for name, file in (("stdout", out), ("stderr", err)):
                tee = getattr(sys, name)
                if not isinstance(tee, Tee):
                    tee = Tee(tee)
                    setattr(sys, name, tee)
                tee.files[me] = file
                tees[name] = tee
        try:
            yield err
        finally:
            with _TEES:
                for name, tee in tees.items():
                    tee.files.pop(me, None)
                    if not tee.files and getattr(sys, name) is tee:
                        setattr(sys, name, tee.stream)


def unlink_logs(folder: RunFolder) -> None:
    """Drop the logs/ links of a previous job (before the folder is submitted again)."""
    for link in folder.logs.glob("rank*"):
        if link.is_symlink():
            link.unlink()


def _link_logs(job: Job, world: int) -> None:
    """logs/rank<k>.out and .err -> submitit's files, so a user finds them from the run folder."""
    folder = job.folder
    folder.logs.mkdir(exist_ok=True)
    for rank in range(world):
        paths = job.paths(rank)
        for suffix, target in (("out", paths.stdout), ("err", paths.stderr)):
            link = folder.rank_log(rank, suffix)
            if not link.is_symlink() and not link.exists():
                link.symlink_to(os.path.relpath(target, folder.logs))


def _jsonable(options: dict) -> dict:
    return {k: v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)
            for k, v in options.items()}
