"""Evaluation and expert-token records are layout-independent: EP=2 on two gloo processes gives the eval loss
and the per-expert token counts of one process, on real text (the stdlib demo corpus, bytes)."""
import pytest

from moelab.data.batches import check_data
from moelab.contract.expert_tokens import read_expert_tokens
from moelab.contract.stream import read_events

pytestmark = pytest.mark.slow


def test_eval_and_expert_tokens_on_ep2_match_one_process(helpers, tmp_path):
    text = ["data.kind=text", "data.path=stdlib", "data.val_fraction=0.05", f"data.cache_dir={tmp_path / 'cache'}",
            "train.eval_every=2", "train.eval_batches=2", "train.expert_tokens_every=2",
            "model.moe.capacity_factor=0"]  # which near-tied assignment a capacity drops is rounding's choice
    cfg = helpers.small_config(*text)
    check_data(cfg, progress=False)  # tokenised once here, before any process starts
    helpers.run_single(cfg, tmp_path / "one")
    helpers.run_multi(helpers.small_config(*text, "parallel.ep=2"), tmp_path / "ep2", 2)
    evals = {name: [e for e in read_events(tmp_path / name / "metrics.jsonl") if e["event"] == "eval"]
             for name in ("one", "ep2")}
    assert [e["step"] for e in evals["ep2"]] == [e["step"] for e in evals["one"]] == [2, 4]
    bounds = helpers.layout_bounds(cfg)  # the layout's reordered sums (conftest.layout_bounds)
    assert [e["loss"] for e in evals["ep2"]] == pytest.approx([e["loss"] for e in evals["one"]], rel=bounds.rel,
                                                              abs=0)
    one, ep2 = read_expert_tokens(tmp_path / "one"), read_expert_tokens(tmp_path / "ep2")
    assert [r["step"] for r in one] == [r["step"] for r in ep2] == [2, 4]
    for a, b in zip(one, ep2):
        assert [[e["tokens"] for e in layer] for layer in a["layers"]] == \
               [[e["tokens"] for e in layer] for layer in b["layers"]]
        assert [[[t[:2] for t in e["top"]] for e in layer] for layer in a["layers"]] == \
               [[[t[:2] for t in e["top"]] for e in layer] for layer in b["layers"]]
