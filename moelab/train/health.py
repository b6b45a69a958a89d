"""Expert health: dead and overloaded experts, from each step's global routing demand (tokens per expert
before capacity dropping: an expert capped at its capacity is still overloaded by the router).

- dead: an expert that received no tokens for ``model.moe.dead_expert_steps`` consecutive steps;
- overloaded: an expert whose load this step exceeds ``model.moe.overload_factor`` x the layer's mean load.

Each step event carries ``health = {"dead_experts": [[layer, expert], ...], "overloaded": [[layer, expert,
share], ...]}`` (layer = index among MoE layers, share = the expert's fraction of the layer's assignments). A
``warning`` event (kind "dead_expert" or "overloaded_expert") is emitted when an expert BECOMES dead or
overloaded, not on every step it stays so; an overloaded expert counts as recovered (and may warn again) only
once its load is back at or below the mean, so a load that hovers around the threshold does not flood the
stream. Per-expert load shares, the routing entropy and the router logit norms are in the step's ``routing``
(``load_shares`` turns counts into shares).

    health = ExpertHealth(cfg.model.moe)
    rec["health"], warnings = health.observe(rec["step"], rec["routing"]["routed_per_expert"])
"""
from __future__ import annotations

from moelab.config import MoEConfig


def load_shares(tokens_per_expert: list[list[float]]) -> list[list[float]]:
    """Each expert's fraction of its layer's assignments ([layers][experts]; a layer with none gives zeros)."""
    return [[c / sum(layer) if sum(layer) > 0 else 0.0 for c in layer] for layer in tokens_per_expert]


class ExpertHealth:
    """Tracks every (layer, expert) across steps. Holds only host-side lists: no device work, no sync.

        health = ExpertHealth(cfg.model.moe); record, warnings = health.observe(step, routed_ME)
    """

    def __init__(self, cfg: MoEConfig):
        self.dead_steps, self.overload_factor = cfg.dead_expert_steps, cfg.overload_factor
        self.idle_streak: list[list[int]] = []  # consecutive steps without tokens, per layer and expert
        self.overloaded: set[tuple[int, int]] = set()  # warned about, and not back to the mean load since

    def observe(self, step: int, tokens_per_expert: list[list[float]]) -> tuple[dict, list[dict]]:
        """This step's health dict and the warnings to emit (as ``warning`` event fields)."""
        if not self.idle_streak:
            self.idle_streak = [[0] * len(layer) for layer in tokens_per_expert]
        dead, overloaded, warnings = [], [], []
        for li, counts in enumerate(tokens_per_expert):
            total = sum(counts)
            mean = total / len(counts) if counts else 0.0
            for e, c in enumerate(counts):
                streak = self.idle_streak[li][e] = self.idle_streak[li][e] + 1 if c <= 0 else 0
                if streak >= self.dead_steps:
                    dead.append([li, e])
                    if streak == self.dead_steps:
                        warnings.append({"step": step, "kind": "dead_expert", "layer": li, "expert": e,
                                         "message": f"MoE layer {li}: expert {e} received no tokens for "
                                                    f"{streak} steps"})
                if total > 0 and c <= mean:
                    self.overloaded.discard((li, e))
                if total > 0 and c > self.overload_factor * mean:
                    share = c / total
                    overloaded.append([li, e, round(share, 4)])
                    if (li, e) not in self.overloaded:
                        self.overloaded.add((li, e))
                        warnings.append({"step": step, "kind": "overloaded_expert", "layer": li, "expert": e,
                                         "share": round(share, 4),
                                         "message": f"MoE layer {li}: expert {e} took {share:.1%} of the "
                                                    f"assignments ({c / mean:.1f}x the mean load, over "
                                                    f"{self.overload_factor:g}x)"})
        return {"dead_experts": dead, "overloaded": overloaded}, warnings
