"""Tied embeddings and padding under FSDP2 with expert parallelism (2 gloo processes: dense parameters sharded
over both, experts split) reproduce one process: the head stays the embedding (one parameter: no separate
`output.weight` among the gathered parameters), and every loss, routing count and parameter matches."""
import pytest

pytestmark = pytest.mark.slow

SHARED = ("model.tie_embeddings=true", "model.pad_token_id=7")


def test_tied_and_padded_fsdp_ep2_reproduces_single_process(reference, helpers, tmp_path):
    ref_losses, ref_params, ref_dir = reference(*SHARED)
    cfg = helpers.small_config(*SHARED, "parallel.ep=2")
    bounds = helpers.layout_bounds(cfg)  # the layout's reordered sums (conftest.layout_bounds)
    losses, params = helpers.run_multi(cfg, tmp_path, 2)
    assert "output.weight" not in ref_params and params.keys() == ref_params.keys()
    assert losses == pytest.approx(ref_losses, rel=bounds.rel, abs=0)
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(tmp_path)
    assert [e["routing"]["routed_per_expert"] for e in ev] == [e["routing"]["routed_per_expert"] for e in ref_ev]
    helpers.assert_within(params, ref_params, bounds)
