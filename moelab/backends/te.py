"""Transformer Engine backends: experts as TE GroupedLinear, attention as TE DotProductAttention with TE Linear
projections and TE RMSNorm. Written against TE's documented PyTorch API (transformer_engine.pytorch: Linear,
RMSNorm, GroupedLinear, DotProductAttention); untested on a GPU here (the TE wheel, about 276 MB, could not be
carried to the GPU machine).

Shapes: N routed rows sorted by expert, D hidden, F expert width, E experts; B batch, L sequence, H query heads,
G kv heads, Dh head dim.

The swap happens on the meta-device model before it is materialised, so moelab's initialisation (seeded by
parameter name) and checkpoints see ordinary parameters: TE Linear and RMSNorm keep the names `weight`/`bias`;
TE experts hold `gate_up_proj.weight{e}` [2F, D] and `down_proj.weight{e}` [D, F] per expert.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelab.backends.packages import import_package


class TEGroupedExperts(nn.Module):
    """Routed experts as two TE GroupedLinear layers. GroupedLinear takes the rows per expert as a Python list,
    so this path reads the counts on the host once per layer.

        experts = TEGroupedExperts(num_experts=8, dim=64, ffn=128, device="cuda")
        y_ND = experts(x_ND, counts_E)
    """

    def __init__(self, num_experts: int, dim: int, ffn: int, device="meta"):
        super().__init__()
        te = import_package("te").pytorch
        self.num_experts, self.dim, self.ffn = num_experts, dim, ffn
        self.gate_up_proj = te.GroupedLinear(num_experts, dim, 2 * ffn, bias=False, device=device)
        self.down_proj = te.GroupedLinear(num_experts, ffn, dim, bias=False, device=device)

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        m_splits = counts_E.tolist()  # TE needs the split sizes on the host
        total = sum(m_splits)
        x = x_ND[:total]
        gate_NF, up_NF = self.gate_up_proj(x, m_splits).chunk(2, dim=-1)
        y = self.down_proj(F.silu(gate_NF) * up_NF, m_splits)
        if total < x_ND.shape[0]:  # rows dropped by capacity are not computed
            y = torch.cat([y, y.new_zeros(x_ND.shape[0] - total, y.shape[1])])
        return y


class TEAttentionCore(nn.Module):
    """TE's fused attention as GQAttention's `attend` (q [B,H,L,Dh], k/v [B,G,L,Dh] -> o [B,H,L,Dh]).

        out_BHLD = TEAttentionCore(num_heads=8, num_kv_heads=2, head_dim=64)(q_BHLD, k_BGLD, v_BGLD)
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, window: int = 0):
        super().__init__()
        te = import_package("te").pytorch
        self.core = te.DotProductAttention(num_heads, head_dim, num_gqa_groups=num_kv_heads,
                                           attn_mask_type="causal", qkv_format="bshd",
                                           window_size=(window - 1, 0) if window else None)

    def forward(self, q_BHLD, k_BGLD, v_BGLD):
        B, H, L, Dh = q_BHLD.shape
        bshd = [t.transpose(1, 2).contiguous() for t in (q_BHLD, k_BGLD, v_BGLD)]
        o_BLHD = self.core(*bshd).view(B, L, H, Dh)
        return o_BLHD.transpose(1, 2)


def _te_linear(te, old: nn.Linear) -> nn.Module:
    return te.Linear(old.in_features, old.out_features, bias=old.bias is not None, device="meta")


def _te_rmsnorm(te, old: nn.Module) -> nn.Module:
    return te.RMSNorm(old.weight.shape[0], eps=old.eps, device="meta")


def apply_te(model: nn.Module, cfg, experts: bool, attention: bool) -> None:
    """Replace experts and/or attention modules of a meta-device MoETransformer with TE modules, in place."""
    te = import_package("te").pytorch
    for block in model.layers.values():
        if attention:
            attn = block.attention
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(attn, name, _te_linear(te, getattr(attn, name)))
            for owner, name in ((block, "attention_norm"), (block, "ffn_norm"), (attn, "q_norm"), (attn, "k_norm")):
                if getattr(owner, name, None) is not None:
                    setattr(owner, name, _te_rmsnorm(te, getattr(owner, name)))
            attn.te_core = TEAttentionCore(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.window)
            # GQAttention.attend is the replaceable core; an instance attribute shadows the method
            object.__setattr__(attn, "attend", attn.te_core)
        if experts and block.is_moe:
            old = block.ffn.experts
            block.ffn.experts = TEGroupedExperts(old.num_experts, old.dim, old.ffn)
    if attention and getattr(model, "norm", None) is not None:
        model.norm = _te_rmsnorm(te, model.norm)
