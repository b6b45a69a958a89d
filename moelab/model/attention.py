"""Attention: grouped-query attention (MHA when kv heads == heads) through SDPA, FlashAttention-4 (moelab.backends.fa4),
FlexAttention or an eager reference; sliding windows and GPT-OSS sink logits through flex or eager.

Shapes: B batch, L sequence, D hidden, H query heads, G kv heads, Dh head dim.

``attend`` is the core (q, k, v -> o) and the only part that context parallelism replaces.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from moelab.config import BackendConfig, ConfigError, ModelConfig
from moelab.model.layers import RMSNorm, apply_rope


def causal_attention(q_BHLD, k_BGLD, v_BGLD, backend: str, window: int = 0, sinks_H=None, scale=None,
                     block_mask=None, documents_BL=None):
    """Causal attention with optional sliding window and learned sink logits (GPT-OSS).

    backend "sdpa" (plain causal and packed documents; windows and sinks fall to eager), "fa4" (FlashAttention-4's
    kernels for plain causal attention with equal q and v head dims; the rest as sdpa), "flex" (FlexAttention;
    `block_mask` from `flex_block_mask` may be passed to reuse it), or "eager" (the reference). `scale` defaults
    to 1/sqrt(Dh).
    v may have a different head dim than q and k (MLA). `documents_BL` (packed sequences, moelab.data.sft):
    each token's document number; a token attends only within its document (sdpa and eager: a block-diagonal
    causal mask; flex: a document mask_mod)."""
    H, G = q_BHLD.shape[1], k_BGLD.shape[1]
    if backend == "flex":
        return flex_causal_attention(q_BHLD, k_BGLD, v_BGLD, window, sinks_H, scale, block_mask, documents_BL)
    if backend == "fa4" and not window and sinks_H is None and documents_BL is None \
            and q_BHLD.shape[-1] == v_BGLD.shape[-1] and q_BHLD.shape[2] == k_BGLD.shape[2]:
        from moelab.backends.fa4 import fa4_causal_attention

        return fa4_causal_attention(q_BHLD, k_BGLD, v_BGLD, scale)
    if backend in ("sdpa", "fa4") and not window and sinks_H is None:
        if documents_BL is not None:
            same_B1LS = (documents_BL[:, :, None] == documents_BL[:, None, :])[:, None]
            return F.scaled_dot_product_attention(q_BHLD, k_BGLD, v_BGLD, attn_mask=same_B1LS.tril(), scale=scale,
                                                  enable_gqa=H != G)
        return F.scaled_dot_product_attention(q_BHLD, k_BGLD, v_BGLD, is_causal=True, scale=scale,
                                              enable_gqa=H != G)
    k_BHLD = k_BGLD.repeat_interleave(H // G, dim=1)
    v_BHLD = v_BGLD.repeat_interleave(H // G, dim=1)
    L, S = q_BHLD.shape[2], k_BHLD.shape[2]
    scale = 1 / math.sqrt(q_BHLD.shape[-1]) if scale is None else scale
    scores = (q_BHLD @ k_BHLD.transpose(-1, -2)).float() * scale
    i = torch.arange(L, device=q_BHLD.device)[:, None] + (S - L)
    j = torch.arange(S, device=q_BHLD.device)[None, :]
    allowed = j <= i
    if window:
        allowed = allowed & (i - j < window)
    if documents_BL is not None:  # [L, S] -> [B, 1, L, S]: within each token's document only
        allowed = allowed & (documents_BL[:, :, None] == documents_BL[:, None, :])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks_H is not None:  # a per-head logit that takes probability mass but contributes no value
        sink = sinks_H.float()[None, :, None, None].expand(scores.shape[0], -1, L, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs.to(v_BHLD.dtype) @ v_BHLD)


def module_backend(backend: BackendConfig) -> str:
    """An attention module's backend when built: backend.attention, with `auto` as sdpa until moelab.backends'
    apply_backends resolves it (fa4 where it applies: auto_attention)."""
    return "sdpa" if backend.attention == "auto" else backend.attention


def attention_path(backend: str, device: torch.device, packed: bool) -> str:
    """The path backend.attention takes for one call: "sdpa" (or "fa4") with packed documents runs FlexAttention on a
    GPU (a document mask_mod, block-sparse; sdpa's dense block-diagonal mask ran 1.3x (full) to 1.45x (LoRA) slower
    on an H200, gallery/results' finetune entries) and sdpa's masked kernel on CPU, where FlexAttention has no
    backward; "fa4" off CUDA is sdpa. Any other combination is the backend itself."""
    if backend in ("sdpa", "fa4") and packed and device.type == "cuda":
        return "flex"
    return "sdpa" if backend == "fa4" and device.type != "cuda" else backend


def flex_block_mask(L: int, S: int, window: int, device, documents_BL=None):
    """FlexAttention block mask: causal (queries are the last L of S keys), within `window` keys if > 0, and
    within each token's document where `documents_BL` is given (then one mask per batch row)."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = S - L

    def mask_mod(b, h, q_idx, kv_idx):
        causal = kv_idx <= q_idx + offset
        causal = causal & (q_idx + offset - kv_idx < window) if window else causal
        return causal & (documents_BL[b, q_idx] == documents_BL[b, kv_idx]) if documents_BL is not None else causal

    B = documents_BL.shape[0] if documents_BL is not None else None
    return create_block_mask(mask_mod, B, None, L, S, device=device)


def cached_block_mask(owner: nn.Module, q_BHLD, k_BGLD, window: int, docs=None):
    """The flex block mask for these shapes (and the packed documents `docs`, the very tensor), kept on
    `owner._flex_mask` while they stay."""
    key = (q_BHLD.shape[2], k_BGLD.shape[2], str(q_BHLD.device))
    if owner._flex_mask is None or owner._flex_mask[0] != key or owner._flex_mask[2] is not docs:
        owner._flex_mask = (key, flex_block_mask(key[0], key[1], window, q_BHLD.device, docs), docs)
    return owner._flex_mask[1]


@functools.cache
def _compiled_flex_attention():
    # FlexAttention is only fast compiled (eager materialises the scores); compile once per process.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_causal_attention(q_BHLD, k_BGLD, v_BGLD, window=0, sinks_H=None, scale=None, block_mask=None,
                          documents_BL=None):
    """FlexAttention with the sliding window in the block mask and sinks folded in through the LSE:
    softmax over [scores, sink] = softmax(scores) * sigmoid(lse - sink), so the kernel needs no extra column.
    On CPU it runs uncompiled and forward only (torch has no CPU FlexAttention backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    L, S = q_BHLD.shape[2], k_BGLD.shape[2]
    if not q_BHLD.is_cuda and torch.is_grad_enabled() and q_BHLD.requires_grad:
        raise ConfigError("backend.attention='flex': torch has no FlexAttention backward on CPU; train on a GPU or "
                          "set backend.attention=eager (same results, sinks and windows included)")
    if block_mask is None:
        block_mask = flex_block_mask(L, S, window, q_BHLD.device, documents_BL)
    fn = _compiled_flex_attention() if q_BHLD.is_cuda else flex_attention
    kw = dict(block_mask=block_mask, scale=scale, enable_gqa=q_BHLD.shape[1] != k_BGLD.shape[1])
    try:  # torch >= 2.9 returns the LSE through an AuxRequest and deprecates return_lse
        from torch.nn.attention.flex_attention import AuxRequest

        o_BHLD, aux = fn(q_BHLD, k_BGLD, v_BGLD, **kw, return_aux=AuxRequest(lse=True))
        lse_BHL = aux.lse
    except ImportError:
        o_BHLD, lse_BHL = fn(q_BHLD, k_BGLD, v_BGLD, **kw, return_lse=True)
    if sinks_H is not None:
        o_BHLD = o_BHLD * torch.sigmoid(lse_BHL.float() - sinks_H.float()[None, :, None])[..., None].to(o_BHLD.dtype)
    return o_BHLD


class GQAttention(nn.Module):
    """Grouped-query attention (H query heads sharing G kv heads), optional QK-norm, sliding window and sinks.

        attn = GQAttention(load_config("tiny").model, BackendConfig())
        y_BLD = attn(x_BLD, cos_LD, sin_LD)      # the rotary tables of the positions (and packed documents_BL)
    """
    def __init__(self, cfg: ModelConfig, backend: BackendConfig, window: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.backend, self.window = module_backend(backend), window
        D, H, G, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(D, H * Dh, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(D, G * Dh, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(D, G * Dh, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * Dh, D, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(Dh, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(Dh, cfg.norm_eps) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(H)) if cfg.attention_sinks else None
        self._flex_mask = None  # (shape key, BlockMask, documents) cache for backend 'flex'

    def forward(self, x_BLD, cos_LD, sin_LD, documents_BL=None):
        """`documents_BL`: Long [B, L], packed documents (moelab.model.batch_context); None: plain causal."""
        B, L, _ = x_BLD.shape
        q = self.q_proj(x_BLD).view(B, L, -1, self.head_dim)  # -1: the heads this rank computes (TP)
        k = self.k_proj(x_BLD).view(B, L, -1, self.head_dim)
        v = self.v_proj(x_BLD).view(B, L, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_BHLD = apply_rope(q.transpose(1, 2), cos_LD, sin_LD)
        k_BGLD = apply_rope(k.transpose(1, 2), cos_LD, sin_LD)
        o_BHLD = self.attend(q_BHLD, k_BGLD, v.transpose(1, 2), documents_BL)
        return self.o_proj(o_BHLD.transpose(1, 2).reshape(B, L, -1))

    def attend(self, q_BHLD, k_BGLD, v_BGLD, documents_BL=None):
        backend = attention_path(self.backend, q_BHLD.device, documents_BL is not None)
        block_mask = (cached_block_mask(self, q_BHLD, k_BGLD, self.window, documents_BL) if backend == "flex"
                      else None)
        return causal_attention(q_BHLD, k_BGLD, v_BGLD, backend, self.window, self.sinks,
                                block_mask=block_mask, documents_BL=documents_BL)
