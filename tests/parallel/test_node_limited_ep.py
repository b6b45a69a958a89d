"""Node-limited routing on gloo processes: EP=2 and EP=4 reproduce the single-process run (losses, exact routing
counts), and the dispatcher's measured counts show no token reaching more than max_routed_ranks EP ranks, while
the same run without the limit reaches more."""
import pytest

pytestmark = pytest.mark.slow

# 16 experts in 4 blocks of 4, top-4 from at most 2 blocks
# the full loss: its head gradient sums in one order on any layout, so routing counts (exact, below) cannot flip on a
# tie the chunked loss's per-rank chunk order moved by one ulp (EP=4 flipped one count at step 3)
LIMIT = ("model.moe.top_k=4", "model.moe.routing_ranks=4", "model.moe.max_routed_ranks=2", "backend.loss=full")


@pytest.mark.parametrize("ep", [2, 4])
def test_node_limited_routing_reproduces_one_process_under_ep(ep, reference, helpers, tmp_path):
    ref_losses, _, ref_dir = reference(*LIMIT)
    cfg = helpers.small_config(*LIMIT, f"parallel.ep={ep}")
    losses, _ = helpers.run_multi(cfg, tmp_path, ep)
    assert losses == pytest.approx(ref_losses, rel=helpers.layout_bounds(cfg).rel, abs=0)
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(tmp_path)
    assert [e["routing"]["routed_per_expert"] for e in ev] == [e["routing"]["routed_per_expert"] for e in ref_ev]
    assert [e["routing"]["tokens_per_expert"] for e in ev] == [e["routing"]["tokens_per_expert"] for e in ref_ev]
    cfg = helpers.small_config()
    tokens = cfg.train.global_batch_size * cfg.train.seq_len * (cfg.model.num_layers - cfg.model.num_dense_layers)
    for e in ev:
        reached = e["comm"]["tokens_by_ranks_reached"]
        assert len(reached) == ep + 1 and sum(reached) == tokens  # every token of every MoE layer, once
        assert sum(reached[3:]) == 0  # at most max_routed_ranks = 2 ranks
        assert 0 < e["comm"]["dispatch_token_ranks"] <= e["comm"]["dispatch_rows"]
        assert e["comm"]["dispatch_bytes"] == e["comm"]["dispatch_rows"] * cfg.model.hidden_size * 4
    assert ref_ev[0]["comm"] == {}  # one process sends nothing


def test_without_the_limit_tokens_reach_more_ranks(helpers, tmp_path):
    cfg = helpers.small_config("model.moe.top_k=4", "parallel.ep=4", "train.steps=1")
    helpers.run_multi(cfg, tmp_path, 4)
    reached = helpers.step_events(tmp_path)[0]["comm"]["tokens_by_ranks_reached"]
    assert sum(reached[3:]) > 0
