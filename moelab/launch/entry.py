"""The per-rank entry point: every launcher (local processes, submitit, srun, torchrun) ends here.

    python -m moelab.launch.entry RUN_DIR     # reads RUN_DIR/config.yaml; rank and world from the environment
"""
from __future__ import annotations

import sys
from pathlib import Path

from moelab.config import load_config


def train_rank(run_dir: "str | Path", progress: bool = False) -> dict:
    """Train this rank of the run whose config is RUN_DIR/config.yaml; returns the summary."""
    from moelab.train.trainer import Trainer

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    return Trainer(cfg, run_dir, progress=progress).run()


if __name__ == "__main__":
    train_rank(sys.argv[1], progress="--progress" in sys.argv)
