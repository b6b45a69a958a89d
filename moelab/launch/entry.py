"""The per-rank entry point: every launcher (moelab's local processes, submitit's tasks, srun, torchrun) ends here.

    python -m moelab.launch.entry RUN_DIR                              # train RUN_DIR/config.yaml
    python -m moelab.launch.entry RUN_DIR --bench STEPS WARMUP CMD     # time it (moelab.bench); rank 0 writes
                                                                       # RUN_DIR/bench.json (the gallery's runs)

Rank and world come from the environment (moelab.parallel.env.DistEnv): torchrun's RANK / WORLD_SIZE /
LOCAL_RANK, or SLURM's. Submitit's tasks call `train_rank` directly (moelab.launch.executors.TrainJob).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from moelab.config import load_config
from moelab.run.folder import RunFolder, lock_folder

BENCH_FILE = "bench.json"


def train_rank(run_dir: "str | Path", progress: bool = False) -> dict:
    """Train this rank of the run whose config is RUN_DIR/config.yaml; returns the summary."""
    from moelab.train.trainer import Trainer

    folder = RunFolder(run_dir)
    lock = None
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))  # srun tasks: SLURM's rank
    if int(rank) == 0:  # the one writer of the folder (moelab.run.folder.FolderLock)
        lock = lock_folder(folder.path, "rank 0", wait_s=120.0)
    try:
        return Trainer(load_config(folder.config), folder.path, progress=progress).run()
    finally:
        if lock is not None:
            lock.release()


def bench_rank(run_dir: "str | Path", steps: int, warmup: int, command: str) -> dict:
    """Time this rank's steps of RUN_DIR/config.yaml (moelab.bench.bench); rank 0 writes RUN_DIR/bench.json."""
    from moelab.bench import bench

    folder = RunFolder(run_dir)
    record = dict(bench(load_config(folder.config), steps=steps, warmup=warmup, command=command))
    if int(os.environ.get("RANK", "0")) == 0:
        (folder.path / BENCH_FILE).write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str]) -> None:
    from moelab.launch.executors import quiet_idle_threads

    quiet_idle_threads()  # before torch is imported
    if "--bench" in argv:
        i = argv.index("--bench")
        steps, warmup, command = argv[i + 1: i + 4]
        bench_rank(argv[0], int(steps), int(warmup), command)
    else:
        train_rank(argv[0], progress="--progress" in argv)


if __name__ == "__main__":
    main(sys.argv[1:])
