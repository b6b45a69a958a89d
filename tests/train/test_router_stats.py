"""The router's statistics are named once (moelab.model.router.ROUTER_STATS): the router's stat buffers and
pop_stats follow them, and every one the trainer puts in a step's routing record is a field of the stream's
Routing (moelab.contract.events), under the name the stream gives it."""
import torch

from moelab.config import MoEConfig
from moelab.contract.events import Routing
from moelab.model.router import AVERAGED_STATS, PER_EXPERT_STATS, ROUTER_STATS, SUMMED_STATS, Router
from moelab.train.trainer import STREAM_NAMES


def test_the_routers_buffers_and_pop_stats_follow_the_declared_statistics():
    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=8)
    router = Router(16, cfg)
    buffers = {name for name, _ in router.named_buffers() if name.startswith("stat_")}
    assert buffers == {f"stat_{n}" for n in SUMMED_STATS + AVERAGED_STATS + ("calls",)}
    router(torch.randn(2, 3, 16))
    stats = router.pop_stats()
    assert list(stats) == list(ROUTER_STATS)
    assert all(stats[n].shape == ((4,) if n in PER_EXPERT_STATS else ()) for n in ROUTER_STATS)
    assert stats["tokens_per_expert"].sum() == 2 * 3 * 2  # every assignment counted once, then reset
    assert router.pop_stats()["tokens_per_expert"].sum() == 0


def test_every_statistic_the_trainer_records_is_a_routing_field_of_the_stream():
    stream = set(Routing.KEYS.values())
    recorded = {STREAM_NAMES.get(n, n) for n in ROUTER_STATS if n not in ("aux_loss", "z_loss")}
    assert recorded <= stream, recorded - stream
