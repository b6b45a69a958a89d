"""Small building blocks: RMSNorm, rotary embeddings, the dense SwiGLU feed-forward.

Shapes: B batch, L sequence, D hidden, H heads, Dh head dim, F feed-forward width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics for bf16 inputs, as HF and torchtitan do.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(positions_L: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    """cos and sin of shape [L, dim] for the HF "rotate half" convention (so HF weights load unchanged)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions_L.device, dtype=torch.float32) / dim))
    freqs_LF = positions_L.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs_LF, freqs_LF], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BHLD: torch.Tensor, cos_LD: torch.Tensor, sin_LD: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHLD.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_BHLD * cos_LD + rotated * sin_LD


class SwiGLU(nn.Module):
    """Dense feed-forward: down(silu(gate(x)) * up(x)). Also used for shared experts."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
