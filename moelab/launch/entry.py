"""The per-rank entry point: every launcher (moelab's local processes, submitit's tasks, srun, torchrun) ends here.

    python -m moelab.launch.entry RUN_DIR                              # train RUN_DIR/config.yaml
    python -m moelab.launch.entry RUN_DIR --bench STEPS WARMUP CMD     # time it (moelab.train.bench); rank 0 writes
                                                                       # RUN_DIR/bench.json (the gallery's runs)

Rank and world come from the environment (moelab.parallel.env.DistEnv): torchrun's RANK / WORLD_SIZE /
LOCAL_RANK, or SLURM's. Submitit's tasks call `train_rank` directly (moelab.launch.executors.TrainJob).
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

from moelab.config import load_config
from moelab.contract.folder import RunFolder, lock_folder, write_json

WARM_CHILD = "MOELAB_WARM_CHILD"  # set in a rank that moelab.launch.warm forked: the warm server ends it


def quiet_idle_threads() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless it is set: OpenMP's idle threads sleep instead of spinning between
    parallel regions. It changes no result (the work is split over the same threads), but on a machine whose
    cores are shared (CI, a busy login node) spinning threads took a tiny CPU step from 0.3-0.5 s to 3-15 s.
    Must run before torch is imported (the OpenMP runtime reads it once, when it loads)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def train_rank(run_dir: "str | Path", progress: bool = False) -> dict:
    """Train this rank of the run whose config is RUN_DIR/config.yaml; returns the summary."""
    from moelab.train.trainer import Trainer

    folder = RunFolder(run_dir)
    lock = None
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))  # srun tasks: SLURM's rank
    if int(rank) == 0:  # the one writer of the folder (moelab.contract.folder.FolderLock)
        lock = lock_folder(folder.path, "rank 0", wait_s=120.0)
    try:
        return Trainer(load_config(folder.config), folder.path, progress=progress).run()
    finally:
        if lock is not None:
            lock.release()


def bench_rank(run_dir: "str | Path", steps: int, warmup: int, command: str) -> dict:
    """Time this rank's steps of RUN_DIR/config.yaml (moelab.train.bench.bench); rank 0 writes RUN_DIR/bench.json."""
    from moelab.train.bench import bench

    folder = RunFolder(run_dir)
    record = dict(bench(load_config(folder.config), steps=steps, warmup=warmup, command=command))
    if int(os.environ.get("RANK", "0")) == 0:
        write_json(folder.bench, record)
    return record


def exit_code(body: Callable[[], object]) -> int:
    """Run a rank's body; its exit code: 0 when it returns, SystemExit's code, 1 for any other failure (whose
    traceback goes to stderr, as an uncaught one would). A native crash (SIGSEGV, SIGABRT from a failed malloc
    check, SIGBUS) prints every thread's Python stack to stderr first (faulthandler), so the rank's .err log names
    where it happened. With end_process: how every rank process ends.

        end_process(exit_code(lambda: train_rank(run_dir)))
    """
    faulthandler.enable(all_threads=True)
    try:
        body()
        return 0
    except SystemExit as e:
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


def main(argv: list[str]) -> int:
    """Run this rank; returns its exit code (moelab.launch.entry.exit_code)."""
    quiet_idle_threads()  # before torch is imported

    def body() -> None:
        if "--bench" in argv:
            i = argv.index("--bench")
            steps, warmup, command = argv[i + 1: i + 4]
            bench_rank(argv[0], int(steps), int(warmup), command)
        else:
            train_rank(argv[0], progress="--progress" in argv)

    return exit_code(body)


def end_process(code: int) -> None:
    """End this rank's process without the interpreter's teardown: the exit handlers run first, while the
    interpreter is whole, then the output is flushed and the process exits (os._exit).

    Why (a core dump of the abort, torch 2.13, CPython 3.11): a gloo collective wakes its waiter before the gloo
    worker thread drops the collective's tensors, and dropping a tensor whose Python object the caller released
    takes the GIL (the tensor holds its Python object while C++ references remain). Once the interpreter finalises,
    CPython ends any thread that takes the GIL with pthread_exit; its unwinding meets the noexcept destructor of
    the gloo work and calls std::terminate: "terminate called without an active exception", SIGABRT, in a rank
    whose run had completed. The worker is late only on a busy machine, and torch keeps the process groups (and
    their workers) alive after destroy_process_group, so neither a barrier nor the groups' lifetime closes the
    window: a rank must not finalise. This entry's ranks and the tests' rank entries end here; submitit's tasks
    (moelab.launch.executors.TrainJob), whose interpreter submitit ends, through `end_at_exit`."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def end_at_exit(code: int) -> None:
    """Once the interpreter starts to exit (a process someone else ends, as submitit's task after it saved the
    result), end it by end_process(code) instead of finalising: the other exit handlers run, then os._exit."""
    def handler() -> None:
        atexit.unregister(handler)
        end_process(code)
    atexit.register(handler)


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    if os.environ.get(WARM_CHILD):  # the warm server runs the exit handlers, reports the code and ends the process
        sys.exit(rc)
    end_process(rc)
