"""Fixtures for the live-view tests: hand-written metrics streams (exact times and counts) and one real run."""
from __future__ import annotations

import json

import pytest

from moelab.config import load_config
from moelab.train.trainer import Trainer


def _event(name: str, t: float, /, **fields) -> dict:
    return {"event": name, "schema": 1, "time": t, **fields}


def _step(step: int, t: float, counts_ME: list, mem_R: list, loss: float | None = None) -> dict:
    """A step event shaped like the trainer's (moelab/contract/stream.py), on CPU (allocator reports 0)."""
    per_rank = [{"rank": r, "peak_allocated_gb": 0.0, "peak_reserved_gb": 0.0, "rss_gb": m}
                for r, m in enumerate(mem_R)]
    return _event("step", t, step=step, loss=5.0 - 0.1 * step if loss is None else loss, aux_loss=0.01,
                  z_loss=0.0, lr=1e-3, grad_norm=1.0, skipped=False, tokens=512, step_time_s=1.0,
                  tokens_per_s=1000.0 * len(mem_R), tokens_per_s_per_gpu=1000.0 + step, tflops_per_gpu=0.5,
                  mfu=None, memory={**per_rank[0], "max_peak_allocated_gb": max(mem_R), "per_rank": per_rank},
                  routing={"tokens_per_expert": counts_ME, "dropped_tokens": [0.0] * len(counts_ME),
                           "entropy": [1.0] * len(counts_ME), "logit_norm": [1.0] * len(counts_ME),
                           "capacity_factor": [0.0] * len(counts_ME)})


class Stream:
    """Builds events (one step per second from t=1000) and appends them to a metrics.jsonl."""

    COUNTS_LE = [[10.0, 20.0, 30.0, 0.0], [15.0, 15.0, 15.0, 15.0]]  # layer 0 skewed with a dead expert

    def __init__(self, folder):
        self.folder = folder
        self.path = folder / "metrics.jsonl"
        folder.mkdir(parents=True, exist_ok=True)

    def start(self, total: int = 10, name: str = "synthetic") -> dict:
        return _event("start", 1000.0, config={"name": name, "model": {"num_dense_layers": 1}},
                      total_steps=total, start_step=0)

    def step(self, step: int, mem_R=(0.5, 0.7), counts_ME=None, loss=None) -> dict:
        return _step(step, 1000.0 + step, counts_ME or self.COUNTS_LE, list(mem_R), loss)

    def event(self, name: str, /, t: float = 2000.0, **fields) -> dict:
        return _event(name, t, **fields)

    def write(self, *events, raw: str = "") -> None:
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(e) + "\n" for e in events) + raw)


@pytest.fixture
def stream(tmp_path):
    return Stream(tmp_path / "run")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A real run folder: the tiny preset trained 6 steps in this process."""
    out = tmp_path_factory.mktemp("tiny-run")
    Trainer(load_config("tiny", ["train.steps=6"]), out).run()
    return out
