"""Attention: grouped-query attention (MHA when kv heads == heads) through SDPA or an eager reference.

Shapes: B batch, L sequence, D hidden, H query heads, G kv heads, Dh head dim.

``attend`` is the core (q, k, v -> o) and the only part that context parallelism replaces.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moelab.config import BackendConfig, ModelConfig
from moelab.model.layers import RMSNorm, apply_rope


def causal_attention(q_BHLD, k_BGLD, v_BGLD, backend: str, window: int = 0, sinks_H=None):
    """Causal attention with optional sliding window and learned sink logits (GPT-OSS)."""
    H, G = q_BHLD.shape[1], k_BGLD.shape[1]
    if backend == "sdpa" and not window and sinks_H is None:
        return F.scaled_dot_product_attention(q_BHLD, k_BGLD, v_BGLD, is_causal=True, enable_gqa=H != G)
    k_BHLD = k_BGLD.repeat_interleave(H // G, dim=1)
    v_BHLD = v_BGLD.repeat_interleave(H // G, dim=1)
    L, S = q_BHLD.shape[2], k_BHLD.shape[2]
    scores = (q_BHLD @ k_BHLD.transpose(-1, -2)).float() / math.sqrt(q_BHLD.shape[-1])
    i = torch.arange(L, device=q_BHLD.device)[:, None] + (S - L)
    j = torch.arange(S, device=q_BHLD.device)[None, :]
    allowed = j <= i
    if window:
        allowed = allowed & (i - j < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks_H is not None:  # a per-head logit that takes probability mass but contributes no value
        sink = sinks_H.float()[None, :, None, None].expand(scores.shape[0], -1, L, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs.to(v_BHLD.dtype) @ v_BHLD)


class GQAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: BackendConfig, window: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.backend, self.window = backend.attention, window
        D, H, G, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(D, H * Dh, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(D, G * Dh, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(D, G * Dh, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * Dh, D, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(Dh, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(Dh, cfg.norm_eps) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(H)) if cfg.attention_sinks else None

    def forward(self, x_BLD, cos_LD, sin_LD):
        B, L, _ = x_BLD.shape
        q = self.q_proj(x_BLD).view(B, L, self.num_heads, self.head_dim)
        k = self.k_proj(x_BLD).view(B, L, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BLD).view(B, L, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_BHLD = apply_rope(q.transpose(1, 2), cos_LD, sin_LD)
        k_BGLD = apply_rope(k.transpose(1, 2), cos_LD, sin_LD)
        o_BHLD = self.attend(q_BHLD, k_BGLD, v.transpose(1, 2))
        return self.o_proj(o_BHLD.transpose(1, 2).reshape(B, L, -1))

    def attend(self, q_BHLD, k_BGLD, v_BGLD):
        return causal_attention(q_BHLD, k_BGLD, v_BGLD, self.backend, self.window, self.sinks)
