"""The all-to-all dispatcher on hand-made routing: which rows each rank receives (expert ownership and counts),
the combined output, and the gradients (tokens, and the experts' 1/ep share; see expert_parallel's docstring);
the overlapped two-chunk route (parallel.ep_overlap) gives the same."""
import json
import sys
from pathlib import Path

import pytest
import torch

from moelab.config import load_config
from moelab.launch.local import launch
from moelab.model import MoETransformer
from moelab.parallel.expert_parallel import shard_experts

HERE = Path(__file__).parent


def _label(rank, t):
    return 10.0 * rank + t + 1


@pytest.mark.slow
def test_rows_counts_outputs_and_gradients_on_two_ranks(tmp_path):
    launch([sys.executable, str(HERE / "dispatch_worker.py"), str(tmp_path)], 2, tmp_path / "logs")
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Routing (dispatch_worker.EXPERTS_TK): rank 0 tokens -> (0,2) (1,3) (2,0); rank 1 -> (3,1) (2,3) (0,1).
    # Rank 0 owns experts 0 and 1, rank 1 owns 2 and 3; rows arrive grouped by expert, then by source rank.
    a, b = (lambda t: _label(0, t)), (lambda t: _label(1, t))
    plain = [res[0]["plain"], res[1]["plain"]]
    assert plain[0]["counts"] == [3, 3] and plain[1]["counts"] == [3, 3]
    assert plain[0]["received"] == [a(0), a(2), b(2), a(1), b(0), b(2)]  # expert 0, then expert 1
    assert plain[1]["received"] == [a(0), a(2), b(1), a(1), b(0), b(1)]  # expert 2, then expert 3
    # y_t = sum_k w_k * (e_k + 1) * x_t, with w = (0.75, 0.25)
    routes = {0: [[0, 2], [1, 3], [2, 0]], 1: [[3, 1], [2, 3], [0, 1]]}
    for r in range(2):
        factor = [0.75 * (e0 + 1) + 0.25 * (e1 + 1) for e0, e1 in routes[r]]
        assert plain[r]["y"] == pytest.approx([f * _label(r, t) for t, f in enumerate(factor)])
        assert plain[r]["x_grad"] == pytest.approx(factor)
    # d(sum y[:, 0])/d(s_e) = sum of w * x over the rows of expert e, from both ranks' tokens
    assert plain[0]["scale_grad"][0] == pytest.approx(0.75 * a(0) + 0.25 * a(2) + 0.75 * b(2))
    assert plain[1]["scale_grad"][1] == pytest.approx(0.25 * a(1) + 0.75 * b(0) + 0.25 * b(1))

    # Capacity: rank 0 drops its token 0's second choice (expert 2), rank 1 its token 2's (expert 1).
    cap = [res[0]["capacity"], res[1]["capacity"]]
    assert cap[0]["counts"] == [3, 2] and cap[1]["counts"] == [2, 3]
    assert cap[0]["received"] == [a(0), a(2), b(2), a(1), b(0)]
    assert cap[1]["received"] == [a(2), b(1), a(1), b(0), b(1)]
    assert cap[0]["y"][0] == pytest.approx(0.75 * 1 * a(0))  # the dropped half contributes nothing
    assert cap[1]["y"][2] == pytest.approx(0.75 * 1 * b(2))

    # parallel.ep_overlap: the two-chunk route gives the same outputs, gradients and counts, each chunk's rows
    # reaching the experts in a call of its own
    for r in range(2):
        for case, over in (("plain", "overlap"), ("capacity", "overlap_capacity")):
            want, got = res[r][case], res[r][over]
            assert want["calls"] == 1 and got["calls"] == 2
            for key in ("y", "x_grad", "scale_grad", "counts", "sent"):
                assert got[key] == want[key], (r, over, key)
            assert sorted(got["received"]) == sorted(want["received"])
            # what overlaps what: chunk 1's dispatch travels while chunk 0's experts compute, chunk 0's combine
            # while chunk 1's; backward mirrors it (combine 0's gradient behind experts 1's backward, dispatch 1's
            # behind experts 0's)
            assert got["events"] == ["start", "experts 0", "wait", "start", "experts 1", "wait", "backward",
                                     "start", "experts 1 backward", "wait", "start", "experts 0 backward", "wait"]
            assert want["events"] == ["experts 0", "backward", "experts 0 backward"]

    # A rank whose (grouped-GEMM) experts receive no rows, in the whole batch or in a chunk, still takes part
    for r in range(2):
        want, got = res[r]["nothing_arrives"], res[r]["nothing_arrives_overlap"]
        for key in ("y", "x_grad", "expert_grads"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), (r, key)
    assert min(res[0]["nothing_arrives"]["expert_grads"]) > 0 and res[1]["nothing_arrives"]["expert_grads"] == [0, 0]


def test_an_ep_rank_initialises_exactly_its_slice_of_the_experts():
    cfg = load_config("tiny")
    full = MoETransformer(cfg.model)
    full.init_weights(3)
    for ep_rank in range(4):
        with torch.device("meta"):
            part = MoETransformer(cfg.model)
        for moe in part.moe_layers():
            shard_experts(moe.experts, ep_rank, 4)
        part.to_empty(device="cpu")
        part.init_weights(3)
        X = cfg.model.moe.num_experts // 4
        for (name, p), q in zip(part.named_parameters(), full.parameters()):
            want = q[ep_rank * X:(ep_rank + 1) * X] if ".experts." in name else q
            assert torch.equal(p, want), name
        assert all(m.experts.num_experts == X and m.experts.expert_offset == ep_rank * X for m in part.moe_layers())
