"""Per-expert learning rates under expert parallelism with expert-FSDP: each rank scales the rows it holds (an
EP slice, further sharded by FSDP2) by the scales of their global experts, so 4 gloo ranks reproduce the
single-process run (moelab.train.expert_lr); and on 2 ranks, where the experts are plain tensors (a one-rank
expert-FSDP mesh is not wrapped: moelab.parallel.fsdp)."""
import pytest

pytestmark = pytest.mark.slow

EXPERT_LR = ("model.moe.expert_lr_power=1.0", "model.moe.expert_lr_max_scale=4.0")


@pytest.mark.parametrize("nproc", [4, 2], ids=["expert_fsdp2", "plain_experts"])
def test_expert_lr_under_ep2_matches_one_process(nproc, reference, helpers, tmp_path):
    ref_losses, ref_params, _ = reference(*EXPERT_LR)
    _, plain_params, _ = reference()
    cfg = helpers.small_config(*EXPERT_LR, "parallel.ep=2")
    bounds = helpers.layout_bounds(cfg)  # the layout's reordered sums (conftest.layout_bounds)
    losses, params = helpers.run_multi(cfg, tmp_path, nproc)
    assert losses == pytest.approx(ref_losses, rel=bounds.rel, abs=0)
    experts = [k for k in ref_params if ".experts." in k]
    assert experts
    helpers.assert_within({k: params[k] for k in experts}, {k: ref_params[k] for k in experts}, bounds)
    # and the scaling did act: the experts differ from a run without it
    assert max((plain_params[k] - ref_params[k]).abs().max().item() for k in experts) > 1e-3
