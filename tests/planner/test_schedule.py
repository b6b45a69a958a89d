"""The planner's copy of torch.distributed.pipelining's interleaved 1F1B order and of its FSDP2 unshard rule
(moelab.planner.schedule) equals torch's own schedule code, action for action."""
from collections import Counter

import pytest

from moelab.planner.schedule import interleaved_gathers, interleaved_order

S = pytest.importorskip("torch.distributed.pipelining.schedules")


def torch_actions(pp: int, vp: int, m: int, rank: int) -> list:
    """ScheduleInterleaved1F1B._calculate_single_rank_operations without building stages."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = S._get_warmup_ops(rank, vp, per_round, pp, m, multiply_factor=2)
    forward = lambda step: (step // per_round) % vp * pp + rank  # noqa: E731
    backward = lambda step: (vp - 1 - ((step - warmup) // per_round) % vp) * pp + rank  # noqa: E731
    return S._get_1f1b_rank_ops(vp, pp, warmup, vp * m - warmup, warmup, rank, forward, backward)


@pytest.mark.parametrize("pp,vp,m", [(4, 8, 8), (8, 4, 16), (4, 2, 8), (2, 2, 4), (4, 3, 12), (4, 8, 32)])
def test_order_and_gathers_match_torch(pp, vp, m):
    for rank in range(pp):
        actions = [a for a in torch_actions(pp, vp, m, rank) if a is not None]
        kind = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B"}
        assert [(a.stage_index, kind[a.computation_type]) for a in actions] == interleaved_order(pp, vp, m, rank)
        lowered = S._add_unshard_reshard(torch_actions(pp, vp, m, rank))
        unshards = Counter(a.stage_index for a in lowered if a.computation_type == S._ComputationType.UNSHARD)
        assert dict(unshards) == interleaved_gathers(pp, vp, m, rank)


def test_three_stages_or_fewer_stay_gathered_and_more_come_back():
    assert set(interleaved_gathers(4, 3, 8, 0).values()) == {1}
    assert max(interleaved_gathers(4, 8, 8, 0).values()) > 1
    assert sum(interleaved_gathers(4, 8, 32, 0).values()) > sum(interleaved_gathers(4, 8, 8, 0).values())
