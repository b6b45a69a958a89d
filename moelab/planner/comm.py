"""The planner's terms for replicated weights and once-per-rank dispatch (issue 25's features): the bytes
replicated parts exchange, and the EP ranks a token reaches (what FSDP2 still gathers: moelab.planner.gathered).

    dispatch_ranks_per_token(MoEConfig(num_experts=64, top_k=8), ep=8)   # 5.43
"""
from __future__ import annotations

import math

from moelab.config import Config


def _replication_comm(cfg: Config, p, dense_sh: float, exp_sh: float, efsdp: int, n_moe: int) -> dict:
    """Bytes one rank sends per step for replicated weights: DDP's ring all-reduce of fp32 dense gradients (once
    per step), and the replicated experts' exchange: a ring all-reduce, or with 1-bit compression an all-gather
    of packed signs and one fp32 scale per expert and stacked tensor (moelab.parallel.compression)."""
    frac = (lambda n: 2 * (n - 1) / n if n > 1 else 0.0)
    ddp = int(frac(p.fsdp * p.cp) * dense_sh * 4) if p.data_parallel == "ddp" else 0
    expert = 0
    if p.expert_dp == "replicate" and efsdp > 1:
        if cfg.train.expert_grad_compression == "sign":
            scales = n_moe * 2 * (cfg.model.moe.num_experts // p.ep)  # gate|up and down of each local expert
            expert = int((efsdp - 1) * (exp_sh / 8 + 4 * scales))
        else:
            expert = int(frac(efsdp) * exp_sh * 4)
    return {"ddp_all_reduce_bytes_per_step": ddp, "expert_grad_bytes_per_step": expert}


def dispatch_ranks_per_token(moe, ep: int) -> float:
    """EP ranks one token's top_k experts sit on, expected under balanced (uniform) routing: ep blocks of E/ep
    experts, K distinct experts, so ep * (1 - C(E - E/ep, K) / C(E, K)). Node-limited routing
    (moe.max_routed_ranks = M over moe.routing_ranks blocks) draws the K from M blocks: with one block per EP rank
    M * (1 - C((M - 1) X, K) / C(M X, K)), X = E/ep; with several blocks per rank at most min(M, the unlimited
    figure; up to 3% low, as the router's chosen blocks hold the best scores and share the K more evenly). A share
    (ep - 1)/ep of them are other ranks. Used for dispatchers that send a token once per rank.

        dispatch_ranks_per_token(MoEConfig(num_experts=64, top_k=8), ep=8)                          # 5.43
        dispatch_ranks_per_token(MoEConfig(num_experts=64, top_k=8, routing_ranks=8, max_routed_ranks=2), 8)  # 2.0
    """
    E, K = moe.num_experts, moe.top_k
    if ep <= 1:
        return 1.0
    free = ep * (1 - math.comb(E - E // ep, K) / math.comb(E, K))
    M = moe.max_routed_ranks
    if not M:
        return free
    if moe.routing_ranks == ep:
        X = E // ep
        return M * (1 - math.comb((M - 1) * X, K) / math.comb(M * X, K))
    return min(float(M), free)
