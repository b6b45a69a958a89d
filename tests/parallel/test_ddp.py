"""Replicated data parallel (parallel.data_parallel=ddp, parallel.expert_dp=replicate) on gloo processes reproduces
the single-process run, as FSDP2 does (tests/parallel/test_equivalence.py): every step's loss, gradient norm and
routing counts, and every parameter after the run."""
import pytest

from moelab.config import ConfigError, load_config

LAYOUTS = {  # name: (processes, overrides)
    "ddp2": (2, ["parallel.data_parallel=ddp"]),  # dense weights by DDP, experts by FSDP2
    "ddp2xep2": (2, ["parallel.data_parallel=ddp", "parallel.ep=2"]),  # experts split by EP, dense by DDP
    "fsdp2_replicated_experts": (2, ["parallel.expert_dp=replicate"]),  # dense FSDP2, experts exchanged by moelab
    "ddp4xep2_replicated_experts": (4, ["parallel.data_parallel=ddp", "parallel.ep=2", "parallel.expert_dp=replicate"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_replicated_layout_reproduces_single_process(name, reference, helpers, tmp_path):
    nproc, overrides = LAYOUTS[name]
    ref_losses, ref_params, ref_dir = reference()
    cfg = helpers.small_config(*overrides)
    bounds = helpers.layout_bounds(cfg)  # what replication reorders (conftest.layout_bounds)
    losses, params = helpers.run_multi(cfg, tmp_path, nproc)
    assert losses == pytest.approx(ref_losses, rel=bounds.rel, abs=0)
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(tmp_path)
    assert [e["routing"]["tokens_per_expert"] for e in ev] == [e["routing"]["tokens_per_expert"] for e in ref_ev]
    # replicated gradients are counted once in the global norm (REPLICAS), not once per rank
    assert [e["grad_norm"] for e in ev] == pytest.approx([e["grad_norm"] for e in ref_ev], rel=bounds.rel, abs=0)
    helpers.assert_within(params, ref_params, bounds)
    # experts are DTensors only where FSDP2 shards them: not replicated, not on a one-rank mesh (ep = dp)
    import json

    kinds = json.loads((tmp_path / "placement_rank0.json").read_text())["params"]
    experts_plain = name == "ddp2xep2" or "replicated_experts" in name
    assert {k for k, v in kinds.items() if ".experts." in k and v == ("dtensor" if experts_plain else "plain")} == set()
    if name == "ddp2":  # the experts' FSDP2 units (each its own root) follow parallel.expert_reshard_after_forward
        from moelab.planner.plan import plan

        got = json.loads((tmp_path / "placement_rank0.json").read_text())
        experts = sorted((k for k in got["units"] if ".experts" in k), key=lambda k: int(k.split(".")[1]))
        assert [got["units"][k]["reshard_after_forward"] for k in experts] == [True] * (len(experts) - 1) + [False]
        planned = plan(helpers.small_config(*overrides), gpus=nproc).comm  # and their collectives are planned
        assert [(c["all_gathers"], c["reduce_scatters"]) for c in got["collectives"]] == [
            (planned["fsdp_all_gathers_per_step"], planned["fsdp_reduce_scatters_per_step"])] * 4
    if "replicated_experts" in name:  # moelab's exchange counted what it sent: an exact ring all-reduce
        comm = ev[0]["comm"]
        assert comm["expert_grad_bytes"] == pytest.approx(comm["expert_grad_uncompressed_bytes"]) and comm[
            "expert_grad_bytes"] > 0


@pytest.mark.parametrize("overrides,field", [
    ({"train.expert_grad_compression": "sign"}, "train.expert_grad_compression"),  # needs replicated experts
    ({"parallel.data_parallel": "ddp", "parallel.pp": 2}, "parallel.data_parallel"),
    ({"parallel.expert_dp": "replicate", "parallel.cp": 2}, "parallel.expert_dp"),
    ({"parallel.expert_dp": "replicate", "train.dtype": "bfloat16"}, "parallel.expert_dp"),
])
def test_unsupported_combinations_are_refused(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("tiny", overrides)


def test_planner_counts_replicated_weights():
    from moelab.planner.plan import plan

    base = {"train.micro_batch_size": 1}
    fsdp = plan(load_config("tiny", base), gpus=4)
    ddp = plan(load_config("tiny", {**base, "parallel.data_parallel": "ddp"}), gpus=4)
    both = plan(load_config("tiny", {**base, "parallel.data_parallel": "ddp", "parallel.expert_dp": "replicate"}),
                gpus=4)
    # every rank holds every dense weight, its gradient and both AdamW moments, in fp32
    assert both.params_per_gpu == fsdp.total_params
    assert both.memory["parameters"] == 4 * fsdp.total_params and both.memory["optimizer"] == 8 * fsdp.total_params
    assert fsdp.params_per_gpu < ddp.params_per_gpu < both.params_per_gpu
    assert ddp.comm["fsdp_all_gather_bytes_per_step"] < fsdp.comm["fsdp_all_gather_bytes_per_step"]
    assert ddp.comm["ddp_all_reduce_bytes_per_step"] > 0 and fsdp.comm["ddp_all_reduce_bytes_per_step"] == 0
    assert both.memory["gathered_params"] == 0
    sign = plan(load_config("tiny", {**base, "parallel.expert_dp": "replicate",
                                     "train.expert_grad_compression": "sign"}), gpus=4)
    plain = plan(load_config("tiny", {**base, "parallel.expert_dp": "replicate"}), gpus=4)
    # 4 ranks: (W-1) x 1/8 of the fp32 bytes plus scales, against 2(W-1)/W: about 5x fewer
    assert 4 < plain.comm["expert_grad_bytes_per_step"] / sign.comm["expert_grad_bytes_per_step"] < 64 / 4
