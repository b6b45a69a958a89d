"""The planner's FSDP2 schedule (moelab.planner.gathered): what gradient sync once per step holds unsharded, and
the collectives each setting issues per step. The same counts are held to the ranks' own in
tests/parallel/test_equivalence.py (test_fsdp_collectives_follow_the_planned_schedule)."""
import pytest

from moelab.config import load_config
from moelab.layout.dims import grad_sync
from moelab.planner.flops import count_params
from moelab.planner.plan import plan

BATCH = ["train.global_batch_size=32", "train.micro_batch_size=2"]  # 4 ranks: 4 micro batches per rank


def _plan(*overrides, gpus=4):
    return plan(load_config("tiny", BATCH + list(overrides)), gpus=gpus)


def test_auto_reduces_every_micro_batch_except_under_pipelines():
    assert grad_sync(load_config("tiny").parallel) == "micro_batch"  # FSDP2's and torchtitan's default
    assert grad_sync(load_config("tiny", ["parallel.pp=2"]).parallel) == "step"  # torch's schedule does it
    assert grad_sync(load_config("tiny", ["parallel.fsdp_grad_sync=step"]).parallel) == "step"


def test_step_holds_every_weight_and_gradient_unsharded():
    """fp32 on 4 ranks with every parameter FSDP2's: between micro batches the rank's gathered weights and its
    gradients are the whole model's weights and fp32 gradients (gathered + held + the sharded gradients that
    held stands in for); reducing every micro batch holds nothing more."""
    micro, step = _plan(), _plan("parallel.fsdp_grad_sync=step")
    assert micro.memory["held_unsharded"] == 0
    total = count_params(load_config("tiny").model).total
    unsharded = step.memory["gathered_params"] + step.memory["held_unsharded"] + step.memory["gradients"]
    assert unsharded == pytest.approx(total * (4 + 4), rel=1e-4)
    assert step.memory_per_gpu_bytes > micro.memory_per_gpu_bytes
    # bf16 reduction accumulates bf16 gradients: less held
    assert _plan("parallel.fsdp_grad_sync=step", "parallel.reduce_dtype=bfloat16").memory["held_unsharded"] < \
        step.memory["held_unsharded"]
    # one micro batch per step: the last is the only one, nothing is held
    one = plan(load_config("tiny", ["train.global_batch_size=8", "train.micro_batch_size=2",
                                    "parallel.fsdp_grad_sync=step"]), gpus=4)
    assert one.micro_batches_per_step == 1 and one.memory["held_unsharded"] == 0


def test_pipeline_stages_hold_their_gradients_unsharded():
    """torch's pipeline schedule keeps FSDP2's gradients unsharded until the step's last backward: a stage
    plans at least its whole weights (bf16: the proxy computes in bf16) and fp32 gradients; each unit gathers
    and reduces once per step."""
    p = plan(load_config("qwen3-moe-30b-a3b-proxy", ["train.global_batch_size=8", "train.micro_batch_size=1",
                                                     "parallel.pp=2"]), gpus=4)
    assert p.fsdp_grad_sync == "step" and p.micro_batches_per_step == 4
    assert p.memory["held_unsharded"] > 0
    unsharded = p.memory["gathered_params"] + p.memory["held_unsharded"] + p.memory["gradients"]
    assert unsharded >= p.stage_params[p.stage] * (2 + 4)
    assert p.comm["fsdp_reduce_scatters_per_step"] == p.comm["fsdp_all_gathers_per_step"] > 0


def test_the_reference_fsdp_row_cannot_hold_its_gradients_unsharded():
    """GPT-OSS-120B on 64 GPUs, FSDP only ([1,1,1,-,-,64], global batch 512, micro batch 2: 4 micro batches):
    syncing once per step would hold every one of its 117B parameters' fp32 gradients on each GPU; the verdict
    says so and names the setting."""
    cfg = load_config("gpt-oss-120b", {"parallel.fsdp": 64, "train.global_batch_size": 512,
                                       "train.micro_batch_size": 2, "train.seq_len": 4096})
    micro, step = plan(cfg, gpus=64), plan(cfg.replace(**{"parallel.fsdp_grad_sync": "step"}), gpus=64)
    assert micro.memory["held_unsharded"] == 0
    assert step.memory["held_unsharded"] > 4 * step.total_params * 0.9  # fp32, less the sharded share
    assert not step.fits and step.biggest_term == "held_unsharded"
    assert "parallel.fsdp_grad_sync=micro_batch" in step.verdict
    assert step.comm["fsdp_reduce_scatter_bytes_per_step"] * 4 == pytest.approx(
        micro.comm["fsdp_reduce_scatter_bytes_per_step"], rel=1e-6)


@pytest.mark.parametrize("reshard", ["default", "never", "always"])
def test_step_sync_reduces_once_and_gathers_less(reshard):
    """Per step and unit: every micro batch reduce-scatters m times, once per step once; all-gathers drop from
    m (1 + reshards) to 1 + m reshards, so by m - 1 per unit."""
    micro = _plan(f"parallel.reshard_after_forward={reshard}").comm
    step = _plan(f"parallel.reshard_after_forward={reshard}", "parallel.fsdp_grad_sync=step").comm
    m, units = 4, step["fsdp_reduce_scatters_per_step"]
    assert units == load_config("tiny").model.num_layers + 1  # the blocks and the root
    assert micro["fsdp_reduce_scatters_per_step"] == m * units
    assert micro["fsdp_all_gathers_per_step"] - step["fsdp_all_gathers_per_step"] == (m - 1) * units
    assert micro["fsdp_reduce_scatter_bytes_per_step"] == m * step["fsdp_reduce_scatter_bytes_per_step"]
    if reshard == "never":  # gathered once per micro batch, or once per step
        assert micro["fsdp_all_gathers_per_step"] == m * units and step["fsdp_all_gathers_per_step"] == units
    # the bytes (what moelab.planner.speed times) follow the gathers
    assert micro["fsdp_all_gather_bytes_per_step"] > step["fsdp_all_gather_bytes_per_step"]


def test_reduce_dtype_halves_the_scheduled_reduce_bytes():
    fp32, bf16 = _plan().comm, _plan("parallel.reduce_dtype=bfloat16").comm
    assert bf16["fsdp_reduce_scatter_bytes_per_step"] * 2 == pytest.approx(fp32["fsdp_reduce_scatter_bytes_per_step"],
                                                                             abs=16)  # rounding per unit
