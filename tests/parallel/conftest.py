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


F32_EPS = torch.finfo(torch.float32).eps  # 2**-23: float32's relative rounding unit


def layout_bounds(cfg):
    """How far a layout may move a run from one process's when all it changes is the order of float32 sums,
    derived from what it reorders (no CPU's figures in it; the golden-loss test's ulps argument, over a run):

    - tokens = global_batch_size x seq_len: the sums a data-, expert- or FSDP-parallel layout splits over ranks
      and adds up in another order (each step's loss, aux loss, every replicated weight's gradient). Two orders
      of a sum of n terms differ by at most about n float32 roundings (relative; the classic gamma_n bound).
    - steps: every step's rounding is carried into the parameters and from them into the next step's sums, so
      after `steps` steps the bound is steps x tokens x eps (relative): for the losses, aux losses, gradient
      norms and each parameter tensor's relative norm difference. Adam passes a relative gradient error into
      its normalised update about unchanged.
    - abs: Adam's update of an element whose gradient is rounding noise (near zero) has any sign and a size of
      up to about lr, so two runs' element can part by up to 2 lr per step: 2 x steps x lr.

    For the tiny SMALL config (256 tokens, 4 steps) rel = 1.2e-4: a layout that drops one rank's gradient term
    moves the parameters far past it (test_equivalence.test_the_bounds_catch_a_dropped_gradient_term)."""
    import types

    tokens, steps = cfg.train.global_batch_size * cfg.train.seq_len, cfg.train.steps
    return types.SimpleNamespace(tokens=tokens, steps=steps, rel=steps * tokens * F32_EPS,
                                 abs=2 * steps * cfg.train.lr)


def param_differences(params, ref_params) -> dict:
    """{name: (max abs difference, relative norm difference)} of two full parameter sets of the same shapes."""
    assert params.keys() == ref_params.keys()
    out = {}
    for key, ref in ref_params.items():
        assert params[key].shape == ref.shape, key
        d = params[key] - ref
        out[key] = (d.abs().max().item(), (d.norm() / ref.norm().clamp(min=1e-12)).item())
    return out


def assert_within(params, ref_params, bounds, max_abs=None, max_rel=None) -> dict:
    """Every parameter within `bounds` (layout_bounds; max_abs / max_rel replace its figures where a test has
    another derivation); returns the differences (the worst are in the message when it fails)."""
    diff = param_differences(params, ref_params)
    max_abs = bounds.abs if max_abs is None else max_abs
    max_rel = bounds.rel if max_rel is None else max_rel
    worst = sorted(diff.items(), key=lambda kv: -kv[1][1])[:3]
    assert max(d[0] for d in diff.values()) < max_abs, (max_abs, max(diff.items(), key=lambda kv: kv[1][0]))
    assert max(d[1] for d in diff.values()) < max_rel, (max_rel, worst)
    return diff


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
                                 step_losses=step_losses, step_events=step_events, here=HERE,
                                 layout_bounds=layout_bounds, param_differences=param_differences,
                                 assert_within=assert_within)
