"""Fixtures for the launch tests. The REAL local SLURM cluster fixture (`slurm_cluster`, never a mock) is in
tests/conftest.py: the SLURM notebook test in tests/live uses it too.
"""
from __future__ import annotations

import pytest

from moelab import Session


# A model small enough that a step takes a fraction of a second on one core.
SMALL = dict(model={"num_layers": 2, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                    "dense_ffn_size": 64, "vocab_size": 128, "moe": {"num_experts": 4, "top_k": 2,
                                                                     "expert_ffn_size": 32}},
             train={"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu",
                    "warmup_steps": 1})


def small(**sections) -> Session:
    """Session("tiny") shrunk to SMALL, with `sections` merged on top."""
    merged = {k: dict(v) for k, v in SMALL.items()}
    for k, v in sections.items():
        if isinstance(v, dict) and k in merged:
            merged[k].update(v)
        else:
            merged[k] = v
    return Session("tiny", **merged)


@pytest.fixture(scope="session")
def small_session():
    """The `small` factory, for tests (with --import-mode=importlib a test cannot import conftest)."""
    return small
