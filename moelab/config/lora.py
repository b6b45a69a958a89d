"""The train.lora section of a config: its dataclass (LoRAConfig, moelab.config's TrainConfig.lora) and its
rules (check_lora, called by Config.validate after moelab.config.rules.check): target names, and what LoRA runs with.

    load_config("tiny", {"train.lora.rank": 8, "train.lora.targets": "attention,experts"}).train.lora
    resolve_lora_targets(cfg.model, "attention")      # ['q_proj', 'k_proj', 'v_proj', 'o_proj'] on GQA
"""
from __future__ import annotations

from dataclasses import dataclass

from moelab.config.rules import _fail


@dataclass
class LoRAConfig:
    """LoRA fine-tuning (moelab.model.lora), off while rank = 0: low-rank adapters on the named modules train,
    every base weight is frozen; routed experts get grouped LoRA over their stacked weights.

        load_config("tiny", {"train.lora.rank": 8, "train.lora.targets": "attention,experts"}).train.lora
    """
    rank: int = 0  # 0 = off
    alpha: float = 16.0  # the adapters' update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input (training only)
    # Comma-separated (LORA_TARGETS): attention (every attention projection the model has), q_proj k_proj v_proj
    # o_proj (GQA; MLA has q_proj without q_lora_rank, and o_proj), MLA's q_a_proj q_b_proj kv_a_proj kv_b_proj,
    # dense_mlp (dense layers' FFN), shared_experts, experts (routed: grouped LoRA).
    targets: str = "attention"
    # False (default): the router stays the base's (frozen); True: its weights train too (and are checkpointed).
    train_router: bool = False


# train.lora.targets names (moelab.model.lora): "attention" stands for every attention projection of the model.
GQA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_TARGETS = ("attention", "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj",
                "kv_b_proj", "dense_mlp", "shared_experts", "experts")


def lora_targets(text: str) -> list[str]:
    """train.lora.targets as a list of names, in order, without repeats."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    return list(dict.fromkeys(names))


def lora_modules_present(m) -> list[str]:
    """The train.lora.targets names (other than 'attention') that name at least one module of ModelConfig `m`."""
    if m.attention == "mla":
        attn = (["q_a_proj", "q_b_proj"] if m.q_lora_rank else ["q_proj"]) + ["kv_a_proj", "kv_b_proj", "o_proj"]
    else:
        attn = list(GQA_PROJECTIONS)
    ffn = (["dense_mlp"] if m.num_dense_layers else []) + (
        (["shared_experts"] if m.moe.num_shared_experts else []) + ["experts"] if m.num_layers > m.num_dense_layers
        else [])
    return attn + ffn


def resolve_lora_targets(m, text: str) -> list[str]:
    """The module names train.lora.targets covers in ModelConfig `m` ('attention' expanded)."""
    present = lora_modules_present(m)
    out = []
    for n in lora_targets(text):
        out += [a for a in present if a not in ("dense_mlp", "shared_experts", "experts")] if n == "attention" \
            else [n]
    return list(dict.fromkeys(out))


def check_lora(cfg) -> None:
    """train.lora: the adapters' sizes, targets that exist in this model, and what LoRA runs with."""
    lo, m, t, b, p = cfg.train.lora, cfg.model, cfg.train, cfg.backend, cfg.parallel
    if lo.rank == 0:
        return
    if lo.alpha <= 0:
        _fail("train.lora.alpha", lo.alpha, "must be > 0 (the update is scaled by alpha / rank)")
    if not 0 <= lo.dropout < 1:
        _fail("train.lora.dropout", lo.dropout, "must be within [0, 1)")
    names = lora_targets(lo.targets)
    if not names:
        _fail("train.lora.targets", lo.targets, f"name at least one of {', '.join(LORA_TARGETS)}")
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown:
        _fail("train.lora.targets", lo.targets, f"unknown target {', '.join(unknown)}; valid targets: "
              f"{', '.join(LORA_TARGETS)}")
    present = lora_modules_present(m)
    absent = [n for n in names if n != "attention" and n not in present]
    if absent:
        _fail("train.lora.targets", lo.targets, f"{', '.join(absent)} name no module of this model "
              f"(model.attention={m.attention!r}, q_lora_rank={m.q_lora_rank}, num_dense_layers="
              f"{m.num_dense_layers}, num_shared_experts={m.moe.num_shared_experts}); it has: {', '.join(present)}")
    if "experts" in names and b.experts in ("grouped_gemm", "te", "triton_fused", "sonic"):
        _fail("backend.experts", b.experts, "grouped LoRA on the routed experts runs with the torch experts "
              "(auto, grouped_mm, loop); set one of them, or drop 'experts' from train.lora.targets")
    if b.attention == "te" and m.attention != "mla":
        _fail("backend.attention", b.attention, "TE attention replaces the GQA projections that LoRA adapts; "
              "set backend.attention=sdpa (or eager, flex) with train.lora")
    if t.fp8 != "off":
        _fail("train.fp8", t.fp8, "FP8 projections and experts have no LoRA path; set train.fp8=off with train.lora")
    for name, value, runs in (("parallel.pp", p.pp, 1), ("parallel.data_parallel", p.data_parallel, "fsdp"),
                              ("parallel.expert_dp", p.expert_dp, "fsdp")):
        if value != runs:
            _fail(name, value, f"LoRA runs with FSDP2 and EP (and CP), not tested here with {name}={value!r}; set "
                  f"{name}={runs!r}")
    if not lo.train_router and m.moe.bias_update_rate > 0 and m.num_layers > m.num_dense_layers:
        _fail("model.moe.bias_update_rate", m.moe.bias_update_rate, "would move the expert bias of a frozen "
              "router (train.lora.train_router=false); set it to 0, or train.lora.train_router=true")
