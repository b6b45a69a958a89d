"""The planner option fsdp_one_rank (moelab.planner.comm.FSDP_ONE_RANK): "plain", moelab's code, is what every plan
counts unless asked; "wrapped" plans the code from before 6131a2c, which sent every FSDP2 unit through fully_shard
whatever its mesh, for records measured with it (moelab.gallery.records.planner_options). Today's rule on the real
layouts: tests/parallel/test_lean_fsdp.py."""
from types import SimpleNamespace

import pytest

from moelab.config import ConfigError, load_config
from moelab.planner.comm import wrapped
from moelab.planner.plan import plan

BF16 = ["train.dtype=bfloat16", "train.param_dtype=bfloat16", "train.global_batch_size=8"]


def _plan(*overrides, one_rank=None):
    cfg = load_config("qwen3-moe-30b-a3b-proxy", BF16 + list(overrides))
    return plan(cfg, gpus=2) if one_rank is None else plan(cfg, gpus=2, fsdp_one_rank=one_rank)


@pytest.mark.parametrize("dense_dp", ["fsdp", "ddp"])
@pytest.mark.parametrize("expert_dp", ["fsdp", "replicate"])
@pytest.mark.parametrize("ep", [1, 2])
def test_the_old_code_wrapped_every_unit_and_differs_only_on_one_rank_meshes(dense_dp, expert_dp, ep):
    """Before 6131a2c the planner's rule (moelab.planner.comm._fsdp_units then) was: dense parts wrapped under
    data_parallel=fsdp, experts under expert_dp=fsdp, whatever the mesh; on meshes of two or more ranks the
    code has not changed."""
    cfg = load_config("tiny", ["train.dtype=bfloat16", "train.param_dtype=bfloat16"])
    p = SimpleNamespace(data_parallel=dense_dp, expert_dp=expert_dp, ep=ep, tp=1)
    for shard, efsdp in ((1, 1), (2, 1), (1, 2), (4, 2)):
        assert wrapped(cfg, p, shard, efsdp, "wrapped") == (dense_dp == "fsdp", expert_dp == "fsdp")
    assert wrapped(cfg, p, 4, 2, "wrapped") == wrapped(cfg, p, 4, 2)


def test_plain_is_the_default_and_a_layout_without_one_rank_meshes_plans_the_same():
    assert _plan("parallel.ep=2").to_dict() == _plan("parallel.ep=2", one_rank="plain").to_dict()
    today, old = _plan(), _plan(one_rank="wrapped")  # FSDP=2, experts in their blocks: no one-rank mesh
    assert (today.memory, today.comm) == (old.memory, old.comm)
    assert "one-rank meshes are not wrapped" in " ".join(today.assumptions)
    assert "fsdp_one_rank=wrapped" in " ".join(old.assumptions)


def test_wrapped_one_rank_experts_are_gathered_and_copied_but_send_nothing():
    """EP over both ranks (expert-FSDP of one rank): the old code's expert units hold a gathered copy and an
    unsharded gradient, and FSDP2 copies them every micro batch, with no collective to issue."""
    today, old = _plan("parallel.ep=2"), _plan("parallel.ep=2", one_rank="wrapped")
    assert old.memory["gathered_params"] > today.memory["gathered_params"] > 0
    assert old.memory_per_gpu_bytes > today.memory_per_gpu_bytes
    experts = [u for u in old.comm["fsdp_units"] if "experts" in u["name"]]
    assert experts and all(u["ranks"] == 1 for u in experts)
    assert not any("experts" in u["name"] for u in today.comm["fsdp_units"])
    assert old.comm["fsdp_all_gathers_per_step"] == today.comm["fsdp_all_gathers_per_step"]
    assert old.comm["fsdp_gather_copied_bytes_per_step"] > today.comm["fsdp_gather_copied_bytes_per_step"]


def test_wrapped_pipeline_stages_count_their_gathered_blocks():
    """One rank per stage: today's code leaves the bf16 blocks plain (nothing gathered, nothing held); the old
    code wrapped them, so their gathered copies count, as one-rank units that send nothing."""
    today, old = _plan("parallel.pp=2"), _plan("parallel.pp=2", one_rank="wrapped")
    assert today.memory["gathered_params"] == today.memory["held_unsharded"] == 0 and not today.comm["fsdp_units"]
    assert old.memory["gathered_params"] > 0 and old.memory_per_gpu_bytes > today.memory_per_gpu_bytes
    assert old.comm["fsdp_units"] and all(u["ranks"] == 1 for u in old.comm["fsdp_units"])
    assert old.comm["fsdp_all_gathers_per_step"] == 0


def test_an_unknown_value_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="fsdp_one_rank='lean'.*plain, wrapped"):
        _plan(one_rank="lean")
