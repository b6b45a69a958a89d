"""The inline executor: a run trains in the foreground of this process (Session.submit("inline"), `moelab run`
for one rank, a resume of such a run), its output shown where it runs and kept in logs/rank0.out / .err.

    run = Session("tiny", train={"steps": 20}).submit("inline")   # returns once the run has ended
    job = run_inline("runs/tiny")                                  # the same for a prepared folder: its InlineJob
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

from moelab.config import ConfigError
from moelab.contract.folder import RunFolder
from moelab.launch.executor import Executor
from moelab.launch.jobs import InlineJob


class InlineExecutor(Executor):
    """One rank in this process; submit trains each folder in turn and returns their finished jobs.

        InlineExecutor().world_size(2, {})   # ConfigError: the inline executor runs one rank in this process
    """

    name, job_class, in_background = "inline", InlineJob, False

    def options_hint(self, valid: list[str]) -> str:
        return "the inline executor takes no cluster options (it runs in this process)"

    def world_size(self, nproc: int, options: dict) -> int:
        if super().world_size(nproc, options) != 1:
            raise ConfigError(f"nproc={nproc}: the inline executor runs one rank in this process; "
                              f"use executor='local' for several processes")
        return 1

    def submit(self, folders: list, nproc: int, options: dict, submitit_folder, world: int) -> list[InlineJob]:
        return [run_inline(f) for f in folders]


def run_inline(folder: "RunFolder | str | Path", reraise: tuple = (ConfigError,), executor: str = "inline"
               ) -> InlineJob:
    """Train in this process (blocking) and return the finished job; run.json names `executor` (an executor
    that trains in this process as inline does may name itself). A failure is recorded, not raised (status
    FAILED, the traceback in the stream), except the `reraise` kinds (bad input found at setup: a ConfigError
    such as a missing backend package), which are recorded and raised; Ctrl-C records CANCELLED and is
    re-raised."""
    from moelab.launch.entry import train_rank

    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    info = {"name": folder.name, "executor": executor, "created": time.time(), "status": "RUNNING",
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
