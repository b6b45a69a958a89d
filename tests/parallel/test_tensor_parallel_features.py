"""Features that run under tensor parallelism (moelab.parallel.tensor) on gloo processes, each reproducing the
single-process run as tests/parallel/test_tensor_parallel.py holds its layouts (the same bounds, derived there:
what TP changes is the order of float32 sums): selective recompute, the fake balanced gate; and what stays
refused under TP, with the reason.
"""
import importlib.util
import json
from pathlib import Path

import pytest

from moelab.config import ConfigError, load_config

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("tensor_parallel_layouts",
                                               Path(__file__).with_name("test_tensor_parallel.py"))
TP = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TP)  # its SHARED overrides, bounds (LR) and collective formula

SELECTIVE = "train.activation_checkpointing=selective"
# 12 experts: a rank's 16 positions of a 32-token sequence start the round robin 16 x top_k = 32 assignments on,
# which is 8 experts further (mod 12), not 0 as with tiny's 16: a gate counting a rank's shard routes otherwise
FAKE_GATE = ("backend.fake_balanced_gate=true", "model.moe.num_experts=12")
LAYOUTS = {  # name: (processes, layout overrides, overrides shared with the single-process reference)
    # the router runs once, the rest of the MoE layer is recomputed on this rank's sequence shard (one process
    # without recompute as the reference: selective recompute changes no value)
    "tp2-selective": (2, ["parallel.tp=2", SELECTIVE], ()),
    # under EP the routed experts rerun on the rows the dispatch delivered (no second all-to-all)
    "tp2xep2-selective": (4, ["parallel.tp=2", "parallel.ep=2", SELECTIVE], ()),
    "tp2-fakegate": (2, ["parallel.tp=2"], FAKE_GATE),
    "tp2xep2-fakegate": (4, ["parallel.tp=2", "parallel.ep=2"], FAKE_GATE),
    # replicated experts: whole on each rank of the expert-FSDP mesh (the TP pair; with EP the dp ranks), their
    # gradients averaged by the experts' exchange (moelab.parallel.replicate) where FSDP2 would reduce-scatter
    "tp2-replicate": (2, ["parallel.tp=2", "parallel.expert_dp=replicate"], ()),
    "tp2xep2-replicate": (4, ["parallel.tp=2", "parallel.ep=2", "parallel.expert_dp=replicate"], ()),
}


@pytest.fixture(scope="module")
def tp_run(helpers, tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            nproc, overrides, shared = LAYOUTS[name]
            run_dir = tmp_path_factory.mktemp(name)
            cfg = helpers.small_config(*TP.SHARED, *shared, *overrides)
            cache[name] = (*helpers.run_multi(cfg, run_dir, nproc), run_dir)
        return cache[name]

    return get


@pytest.mark.parametrize("name", LAYOUTS)
def test_feature_under_tensor_parallel_reproduces_single_process(name, reference, tp_run, helpers):
    ref_losses, ref_params, ref_dir = reference(*TP.SHARED, *LAYOUTS[name][2])
    losses, params, run_dir = tp_run(name)
    assert len(losses) == 4 and losses[0] == pytest.approx(ref_losses[0], rel=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(run_dir)
    assert [e["routing"]["tokens_per_expert"] for e in ev] == [e["routing"]["tokens_per_expert"] for e in ref_ev]
    assert [e["aux_loss"] for e in ev] == pytest.approx([e["aux_loss"] for e in ref_ev], rel=1e-5)
    assert [e["grad_norm"] for e in ev] == pytest.approx([e["grad_norm"] for e in ref_ev], rel=1e-4)
    helpers.assert_within(params, ref_params, None, max_abs=TP.LR / 3, max_rel=2e-3)


@pytest.mark.parametrize("overrides, says", [
    # GPU-only: no several-GPU machine to build and prove them on
    (["train.fp8=rowwise", "train.dtype=bfloat16"], r"train.fp8='rowwise'.*parallel.tp=2.*set train.fp8=off "
                                                    r"\(FP8 GEMMs run on Hopper GPUs only.*several GPUs"),
    (["backend.attention=te"], r"backend.attention='te'.*parallel.tp=2.*set backend.attention=sdpa "
                               r"\(Transformer Engine runs on CUDA GPUs only.*several GPUs"),
    # DDP reduces over one process group; TP's replicated weights need a second sum over the TP ranks
    (["parallel.data_parallel=ddp"], r"parallel.data_parallel='ddp'.*parallel.tp=2.*set parallel.data_parallel="
                                     r"fsdp.*second sum over them"),
])
def test_what_stays_refused_under_tensor_parallel_says_why(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config("tiny", ["parallel.tp=2", *overrides])
