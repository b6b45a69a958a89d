"""Helpers shared by tests in several folders (pyproject puts tests/_support on sys.path for pytest)."""
from __future__ import annotations

import torch


def run_one_thread(cfg, run_dir):
    """Train `cfg` in this process on one CPU thread, like each launched rank (on a busy machine OpenMP's
    spinning threads slow small kernels down a hundredfold); returns the finished Trainer."""
    from moelab.parallel.env import DistEnv
    from moelab.train.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(cfg, run_dir, env=DistEnv())
        trainer.run()
    finally:
        torch.set_num_threads(threads)
    return trainer
