"""Shared experts under TP in the planner (parallel.tp_shared_experts, moelab.parallel.tensor): replicate (the
default) adds no TP collective and FSDP2 gathers them whole with the router over the dp*cp*tp ranks; column_row
adds an all-gather and a reduce-scatter around them per MoE layer, forward and backward, and FSDP2 gathers a
tp-th of them over dp*cp. The counts are those the ranks make (tests/parallel/test_tensor_parallel.py)."""
import pytest

from moelab.config import load_config
from moelab.planner.plan import plan, tp_collectives_per_layer

DSV3_TP = {"parallel.tp": 2, "parallel.pp": 8, "parallel.vp": 4, "parallel.ep": 64, "parallel.fsdp": -1}


def _plans():
    return {mode: plan(load_config("deepseek-v3", {**DSV3_TP, "parallel.tp_shared_experts": mode}), gpus=1024,
                       gpu="h100") for mode in ("replicate", "column_row")}


def test_column_row_shared_experts_add_their_collectives_per_moe_layer_and_micro_batch():
    plans = _plans()
    rep, col = plans["replicate"], plans["column_row"]
    cfg = load_config("deepseek-v3")
    ckpt = cfg.train.activation_checkpointing
    m, pp, dense = rep.micro_batches_per_step, len(rep.stage_layers), cfg.model.num_dense_layers

    def count(layers, rank, moe_gathered):  # per micro batch: blocks, then embedding / head on the end stages
        per_block = [tp_collectives_per_layer(ckpt, 1 + (i < dense or moe_gathered)) for i in layers]
        return sum(per_block) + 2 * (rank == 0) + 2 * (rank == pp - 1)

    # the planned rank (the one needing the most memory) is one of the stages, the same one either way
    stages = [r for r, layers in enumerate(rep.stage_layers)
              if m * count(layers, r, False) == rep.comm["tp_collectives_per_step"]]
    assert stages and all(m * count(rep.stage_layers[r], r, True) == col.comm["tp_collectives_per_step"]
                          for r in stages)
    assert tp_collectives_per_layer(ckpt, 2) - tp_collectives_per_layer(ckpt, 1) == (4 if ckpt == "none" else 5)
    assert col.comm["tp_bytes_per_collective"] == rep.comm["tp_bytes_per_collective"] == 4096 * 7168 * 2 // 2
    # the same FLOPs per rank; more exposed TP time: replicate stays the default (docs/layouts.md)
    assert col.speed.parts_s["tp"] > rep.speed.parts_s["tp"]
    assert load_config("deepseek-v3").parallel.tp_shared_experts == "replicate"


def test_shared_experts_fsdp_units_follow_the_choice():
    plans = _plans()
    d, f = 7168, 2048
    rep = {u["name"]: u for u in plans["replicate"].comm["fsdp_units"]}
    col = {u["name"]: u for u in plans["column_row"].comm["fsdp_units"]}
    router = 256 * d
    # replicate: the router and the whole shared expert, over the 1,024 / pp = 128 ranks that route
    assert rep["moe layers"]["params"] == router + 3 * d * f and rep["moe layers"]["ranks"] == 128
    assert "shared experts" not in rep
    # column_row: the router alone there, a tp-th of the shared expert over the dense mesh's 64 ranks
    assert col["moe layers"]["params"] == router and col["shared experts"]["params"] == 3 * d * f // 2
    assert col["shared experts"]["ranks"] == 64
    assert col["blocks"]["params"] == rep["blocks"]["params"]  # attention's TP half either way
    # gathered whole, replicate gathers the other half of each shared expert too
    assert plans["replicate"].memory["gathered_params"] > plans["column_row"].memory["gathered_params"]
    assert plans["replicate"].memory["parameters"] == pytest.approx(plans["column_row"].memory["parameters"],
                                                                    rel=1e-6)
