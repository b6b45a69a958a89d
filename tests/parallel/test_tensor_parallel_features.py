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
    TP.assert_same_steps(losses, run_dir, ref_losses, ref_dir, helpers)
    helpers.assert_within(params, ref_params, None, max_abs=TP.LR / 3, max_rel=2e-3)


def test_selective_recompute_reruns_only_the_sequence_all_gathers(tp_run, helpers):
    """Selective recompute under TP: the recomputed attention and dense MLP pieces all-gather their input again
    (one more all-gather per gathered sublayer and micro batch); the reduce-scatters of their outputs do not run
    again (the recompute stops once it has what backward needs: torch's non-reentrant checkpoint, and nothing after
    the row-parallel GEMM is needed). Both counts are the planner's (moelab.planner.plan.tp_collectives_per_layer)."""
    from moelab.planner.plan import plan, tp_gathered_sublayers

    nproc, overrides, shared = LAYOUTS["tp2-selective"]
    cfg = helpers.small_config(*TP.SHARED, *shared, *overrides)
    m = cfg.model
    planned = plan(cfg, gpus=nproc)
    gathered = sum(tp_gathered_sublayers(cfg, i >= m.num_dense_layers) for i in range(m.num_layers))
    steps = json.loads((tp_run("tp2-selective")[2] / "placement_rank0.json").read_text())["collectives"]
    for got in steps:
        assert got["tp_all_gathers"] - got["tp_reduce_scatters"] == planned.micro_batches_per_step * gathered, got
        assert got["tp_all_gathers"] + got["tp_reduce_scatters"] == planned.comm["tp_collectives_per_step"], got


@pytest.mark.parametrize("name, nproc, layout", [("tp2", 2, ["parallel.tp=2"]),
                                                 ("tp2xep2", 4, ["parallel.tp=2", "parallel.ep=2"])])
def test_compiled_blocks_under_tensor_parallel_reproduce_single_process(name, nproc, layout, reference, helpers,
                                                                        tmp_path):
    """train.compile=true: each block compiled after TP placed its DTensors (torchtitan's order), with the
    aot_eager backend (compile_backend_entry: dynamo and AOTAutograd trace the DTensor block, the graphs run op by
    op, the same products as eager: held to the uncompiled single process within TP's bounds)."""
    import os

    import torch

    from moelab.launch.local import run_local_processes

    ref_losses, ref_params, ref_dir = reference(*TP.SHARED)
    cfg = helpers.small_config(*TP.SHARED, *layout, "train.compile=true")
    path = os.pathsep.join(filter(None, [str(helpers.here), os.environ.get("PYTHONPATH")]))
    run_local_processes(cfg, tmp_path, nproc, entry="compile_backend_entry",
                        env={"PYTHONPATH": path, "TEST_COMPILE_BACKEND": "aot_eager"})
    for rank in range(nproc):  # every rank compiled its blocks (a graph per block kind and pass, or more)
        assert len((tmp_path / f"compiled_rank{rank}.txt").read_text().split()) >= 2, rank
    losses, params = helpers.step_losses(tmp_path), torch.load(tmp_path / "params.pt")
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(tmp_path)
    assert [e["routing"]["tokens_per_expert"] for e in ev] == [e["routing"]["tokens_per_expert"] for e in ref_ev]
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
