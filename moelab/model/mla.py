"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2).

Shapes (docs/shapes.md): B batch, L sequence, D hidden, H heads, Q q_lora_rank, C kv_lora_rank,
Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim.

Queries go through a low-rank bottleneck (D -> Q, RMSNorm, Q -> H*(Dn+Dr)); keys and values through a compressed
latent (D -> C, RMSNorm, C -> H*(Dn+Dv)) plus one decoupled rotary key of width Dr shared by every head. Only the Dr
dims of q and k are rotated. The rotary layout is HF's "rotate half"; published DeepSeek weights use interleaved
pairs, which moelab.hf permutes at load (a fixed permutation of output rows, so q.k is unchanged).

``attend`` (q, k, v -> o) is the core that context parallelism replaces, as in GQAttention; k has H heads here.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from moelab.config import BackendConfig, ModelConfig
from moelab.model.attention import attention_path, cached_block_mask, causal_attention, module_backend
from moelab.model.layers import RMSNorm, apply_rope, yarn_mscale

# HF and DeepSeek's reference build the two latent norms with RMSNorm's default eps, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(Dn+Dr), times DeepSeek's YaRN correction mscale(factor, mscale_all_dim)^2 when rope scaling is on."""
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    rs = cfg.rope_scaling
    if rs.kind == "yarn" and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V3): low-rank query and key-value projections, a decoupled
    rotary part of the query and key.

        attn = MLAttention(load_config("deepseek-v3-proxy").model, BackendConfig())
        y_BLD = attn(x_BLD, *rope_cos_sin(torch.arange(L), cfg.qk_rope_head_dim, cfg.rope_theta, x_BLD.dtype))
    """

    def __init__(self, cfg: ModelConfig, backend: BackendConfig):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.backend = H, module_backend(backend)
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * qk_dim, bias=False)
            self.q_proj = None
        else:
            self.q_proj = nn.Linear(D, H * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(D, self.kv_rank + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=cfg.attention_bias)
        self.softmax_scale = mla_softmax_scale(cfg)
        self.window, self.sinks = 0, None  # MLA has neither; kept so attend() reads like GQAttention's
        self._flex_mask = None

    def forward(self, x_BLD, cos_LD, sin_LD, documents_BL=None):
        """`documents_BL`: Long [B, L], packed documents (moelab.model.batch_context); None: plain causal."""
        B, L, _ = x_BLD.shape
        Dn, Dr = self.nope_dim, self.rope_dim  # heads: -1, those this rank computes (all of them without TP)
        q = self.q_proj(x_BLD) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BLD)))
        q_nope_BHLDn, q_rope_BHLDr = q.view(B, L, -1, Dn + Dr).transpose(1, 2).split([Dn, Dr], dim=-1)
        H = q_nope_BHLDn.shape[1]
        kv_c_BLC, k_rope_BLDr = self.kv_a_proj(x_BLD).split([self.kv_rank, Dr], dim=-1)
        kv_BHL2 = self.kv_b_proj(self.kv_a_norm(kv_c_BLC)).view(B, L, -1, Dn + self.v_dim).transpose(1, 2)
        k_nope_BHLDn, v_BHLDv = kv_BHL2.split([Dn, self.v_dim], dim=-1)
        q_rope_BHLDr = apply_rope(q_rope_BHLDr, cos_LD, sin_LD)
        k_rope_B1LDr = apply_rope(k_rope_BLDr[:, None], cos_LD, sin_LD)
        q_BHLD = torch.cat([q_nope_BHLDn, q_rope_BHLDr], dim=-1)
        k_BHLD = torch.cat([k_nope_BHLDn, k_rope_B1LDr.expand(-1, H, -1, -1)], dim=-1)
        o_BHLDv = self.attend(q_BHLD, k_BHLD, v_BHLDv, documents_BL)
        return self.o_proj(o_BHLDv.transpose(1, 2).reshape(B, L, H * self.v_dim))

    def attend(self, q_BHLD, k_BHLD, v_BHLDv, documents_BL=None):
        backend = attention_path(self.backend, q_BHLD.device, documents_BL is not None)
        block_mask = cached_block_mask(self, q_BHLD, k_BHLD, 0, documents_BL) if backend == "flex" else None
        return causal_attention(q_BHLD, k_BHLD, v_BHLDv, backend, scale=self.softmax_scale,
                                block_mask=block_mask, documents_BL=documents_BL)
