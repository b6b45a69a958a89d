"""Shared pieces of the multi-process tests: a small fast config, the single-process reference, and runs on N
local gloo processes through moelab's own launcher (moelab.launch.local) with the test entry rank_entry.py.
Tests get the helpers as fixtures (pytest runs with --import-mode=importlib, so conftest is not importable)."""
import os
from pathlib import Path

import pytest
import torch

from moelab.config import load_config
from moelab.launch.local import run_local_processes
from moelab.contract.stream import read_events
from support import run_one_thread

HERE = Path(__file__).parent

# Short and small, with every routing feature that crosses ranks switched on: aux and z losses, capacity
# dropping (the dispatcher's keep mask) and the aux-loss-free bias (fed by globally summed counts).
SMALL = ["train.steps=4", "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.warmup_steps=1", "model.moe.z_loss_coeff=0.001", "model.moe.capacity_factor=1.25",
         "model.moe.bias_update_rate=0.01"]


def small_config(*overrides):
    return load_config("tiny", SMALL + list(overrides))


def step_losses(run_dir):
    return [e["loss"] for e in read_events(Path(run_dir) / "metrics.jsonl") if e["event"] == "step"]


def step_events(run_dir):
    return [e for e in read_events(Path(run_dir) / "metrics.jsonl") if e["event"] == "step"]


def run_single(cfg, run_dir):
    """One process, in this one: (losses, full parameters). One CPU thread, like each launched rank: on a busy
    machine OpenMP's spinning threads slow small kernels down a hundredfold."""
    trainer = run_one_thread(cfg, run_dir)
    return step_losses(run_dir), {k: v.detach().float().clone() for k, v in trainer.model.named_parameters()}


def run_multi(cfg, run_dir, nproc, env=None, grace_s=10.0):
    """`nproc` local processes: (losses, full parameters gathered by rank_entry)."""
    run_local_processes(cfg, run_dir, nproc, entry="rank_entry", grace_s=grace_s,
                        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
                             **(env or {})})
    return step_losses(run_dir), torch.load(Path(run_dir) / "params.pt")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(*overrides) -> (losses, parameters, run folder) of the single-process run of
    small_config(*overrides), computed once per session for each set of overrides."""
    cache = {}

    def get(*overrides):
        if overrides not in cache:
            run_dir = tmp_path_factory.mktemp("single")
            losses, params = run_single(small_config(*overrides), run_dir)
            cache[overrides] = losses, params, run_dir
        return cache[overrides]

    return get


@pytest.fixture(scope="session")
def helpers():
    """The module's helpers: helpers.small_config(...), helpers.run_multi(...), helpers.step_losses(...)."""
    import types

    return types.SimpleNamespace(small_config=small_config, run_multi=run_multi, run_single=run_single,
                                 step_losses=step_losses, step_events=step_events, here=HERE)
