"""LoRA (Hu et al., arXiv 2106.09685): low-rank adapters beside frozen base weights, for fine-tuning.

Shapes (docs/shapes.md): N routed rows, D hidden, F expert width, E local experts, R the adapters' rank,
I / O a linear layer's input / output width.

- Linear layers (attention projections, dense MLP, shared experts) become ``LoRALinear``:
  y = x W^T + b + (alpha / R) * dropout(x) A_RI^T B_OR^T. Their parameters keep their names (``q_proj.weight``)
  and gain ``q_proj.lora_A`` [R, I] and ``q_proj.lora_B`` [O, R], PEFT's layout.
- Routed experts get *grouped LoRA*: per-expert adapters stacked like the experts' weights,
  lora_a_gate_up_EDR / lora_b_gate_up_ERF2 beside w_gate_up_EDF2 and lora_a_down_EFR / lora_b_down_ERD beside
  w_down_EFD, computed with the same token grouping as the experts' grouped GEMM (torch._grouped_mm over the
  same offsets, or one matmul per expert). Dim 0 is the expert, so expert parallelism splits them with the
  experts and FSDP2 shards them like every parameter: nothing here knows about parallelism.
- B starts at zero, so step 0 computes the base model exactly. A is seeded by name (per expert for the stacked
  ones), as every parameter is (MoETransformer.init_weights).
- Every base parameter is frozen (requires_grad=False); the router too unless train.lora.train_router.

    apply_lora(model_on_meta, cfg)            # before parallelize: the adapters are sharded like their bases
    merged = merge_lora_state(full_state, cfg)  # adapters folded into the base weights, adapter keys removed
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelab.config import Config, ConfigError
from moelab.config.lora import resolve_lora_targets
from moelab.model.experts import EXPERT_ADAPTERS, ExpertAdapters, GroupedExperts, expert_adapters  # noqa: F401

ATTENTION_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")
MLP_ATTRS = ("gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update: y = x W^T + b + scaling * dropout(x) A^T B^T (A [R, I], B [O, R]).
    It holds the base layer's own weight and bias (same names, same tensors).

        lin = LoRALinear(nn.Linear(64, 32), rank=8, alpha=16.0)
        y_BLO = lin(x_BLI)                     # equals the base layer's output while lora_B is zero
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, rank, device=w.device, dtype=w.dtype))
        self.scaling, self.dropout = alpha / rank, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        x = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


def add_expert_adapters(experts: GroupedExperts, rank: int, alpha: float, dropout: float = 0.0) -> None:
    """Grouped LoRA on stacked experts: per-expert A and B beside w_gate_up_EDF2 and w_down_EFD (uninitialised)."""
    for a_name, b_name, w_name in EXPERT_ADAPTERS:
        w_EIO = getattr(experts, w_name)
        E, I, O = w_EIO.shape
        kw = dict(device=w_EIO.device, dtype=w_EIO.dtype)
        experts.register_parameter(a_name, nn.Parameter(torch.empty(E, I, rank, **kw)))
        experts.register_parameter(b_name, nn.Parameter(torch.empty(E, rank, O, **kw)))
    experts.lora_rank, experts.lora_scaling, experts.lora_dropout = rank, alpha / rank, dropout


def lora_init_std(leaf: str, shape) -> float | None:
    """The init std of an adapter parameter named `leaf` (0 for B, so the model starts as the base; A:
    1/sqrt(fan in)); None for a parameter that is not an adapter."""
    if leaf == "lora_B" or leaf.startswith("lora_b_"):
        return 0.0
    if leaf == "lora_A":
        return shape[-1] ** -0.5
    if leaf.startswith("lora_a_"):
        return shape[-2] ** -0.5
    return None


def is_adapter(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("lora_A", "lora_B") or leaf.startswith(("lora_a_", "lora_b_"))


def target_modules(model: nn.Module, targets: list[str]) -> dict[str, list[tuple[nn.Module, str]]]:
    """For each target name, the (parent module, attribute) pairs it covers in `model` (a MoETransformer or a
    pipeline stage of one); experts map to (MoE layer, "experts")."""
    found: dict[str, list] = {t: [] for t in targets}
    for block in model.layers.values():
        attn = block.attention
        for name in ATTENTION_ATTRS:
            if name in found and isinstance(getattr(attn, name, None), nn.Linear):
                found[name].append((attn, name))
        ffn = block.ffn
        if not block.is_moe and "dense_mlp" in found:
            found["dense_mlp"] += [(ffn, n) for n in MLP_ATTRS]
        if block.is_moe and "shared_experts" in found and ffn.shared_experts is not None:
            found["shared_experts"] += [(ffn.shared_experts, n) for n in MLP_ATTRS]
        if block.is_moe and "experts" in found:
            found["experts"].append((ffn, "experts"))
    return found


def apply_lora(model: nn.Module, cfg: Config) -> list[str]:
    """Freeze `model` (built on the meta device, before parallelize) and add train.lora's adapters to the
    targets; the router stays trainable with train.lora.train_router. Returns the adapted modules' names.

        apply_lora(model, load_config("tiny", {"train.lora.rank": 8}))   # ['layers.0.attention.q_proj', ...]
    """
    lo = cfg.train.lora
    if lo.rank < 1:
        raise ConfigError(f"train.lora.rank={lo.rank}: apply_lora needs rank >= 1")
    targets = resolve_lora_targets(cfg.model, lo.targets)
    for p in model.parameters():
        p.requires_grad_(False)
    found = target_modules(model, targets)
    empty = [t for t, hits in found.items() if not hits]
    if empty:
        raise ConfigError(f"train.lora.targets={lo.targets!r}: {', '.join(empty)} name no module of this model")
    for hits in found.values():
        for parent, attr in hits:
            mod = getattr(parent, attr)
            if isinstance(mod, GroupedExperts):
                add_expert_adapters(mod, lo.rank, lo.alpha, lo.dropout)
            elif not isinstance(mod, LoRALinear):
                setattr(parent, attr, LoRALinear(mod, lo.rank, lo.alpha, lo.dropout))
    if lo.train_router:
        for block in model.layers.values():
            if block.is_moe:
                for p in block.ffn.router.parameters():
                    p.requires_grad_(True)
    names = [n for n, m in model.named_modules() if isinstance(m, LoRALinear) or getattr(m, "lora_rank", 0)]
    for name, p in model.named_parameters():
        if is_adapter(name):
            p.requires_grad_(True)
    return names


@torch.no_grad()
def merge_lora_state(state: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """A full (unsharded, moelab-named) state dict with every adapter folded into its base weight, in fp32,
    then cast back to the weight's dtype; adapter keys removed. What a plain MoETransformer (and moelab.hf.save_hf)
    loads.

        model.load_state_dict(merge_lora_state(full_state_dict(par), cfg))
    """
    lo = cfg.train.lora
    scaling = lo.alpha / lo.rank if lo.rank else 0.0
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        prefix, _, leaf = key.rpartition(".")
        prefix += "."
        if leaf == "lora_A":
            w_OI = out[prefix + "weight"]
            delta_OI = state[prefix + "lora_B"].float() @ state[key].float()
            out[prefix + "weight"] = (w_OI.float() + scaling * delta_OI).to(w_OI.dtype)
        for a_name, b_name, w_name in EXPERT_ADAPTERS:
            if leaf == a_name:
                w_EIO = out[prefix + w_name]
                delta_EIO = torch.bmm(state[key].float(), state[prefix + b_name].float())
                out[prefix + w_name] = (w_EIO.float() + scaling * delta_EIO).to(w_EIO.dtype)
    return out


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Only the adapters of a state dict."""
    return {k: v for k, v in state.items() if is_adapter(k)}
