"""A per-rank entry point for the tests: moelab.launch.entry's job, plus what only tests need.

    python -m rank_entry RUN_DIR      (with tests/parallel on PYTHONPATH; launched by run_local_processes)

After training, every parameter is gathered to a full tensor (all shards, all experts) and rank 0 saves them to
RUN_DIR/params.pt, so a test can compare them with a single-process run.

Fault injection (tests only, never in moelab): TEST_FAULT="RANK:STEP:exit" makes that rank os._exit(13) when it
starts STEP; "RANK:STEP:hang" makes it sleep instead, like a stuck GPU.
"""
import os
import sys
import time
from pathlib import Path

import torch

from moelab.config import load_config
from moelab.parallel.distributed import full_state_dict
from moelab.train.trainer import Trainer


def main(run_dir: Path) -> None:
    trainer = Trainer(load_config(run_dir / "config.yaml"), run_dir)
    fault = os.environ.get("TEST_FAULT")
    if fault:
        rank, at_step, kind = fault.split(":")
        step_fn = trainer.train_step

        def faulty_step(step):
            if trainer.env.rank == int(rank) and step == int(at_step):
                if kind == "exit":
                    os._exit(13)
                time.sleep(3600)
            return step_fn(step)

        trainer.train_step = faulty_step
    env = trainer.env
    shutdown, env.shutdown = env.shutdown, lambda: None  # keep the process group for the gather below
    trainer.run()
    params = full_state_dict(trainer.par)
    if env.rank == 0:
        torch.save(params, run_dir / "params.pt")
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
