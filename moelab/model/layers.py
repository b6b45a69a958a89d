"""Small building blocks: RMSNorm, rotary embeddings, the gated dense feed-forward and its activations (the routed
rows' weighting, which the experts kernels share, is moelab.backends.ops.scale_rows).

Shapes: B batch, L sequence, D hidden, H heads, Dh head dim, F feed-forward width, N routed rows, I their width.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 and cast back to the input dtype.

        y_BLD = RMSNorm(64)(x_BLD)
    """
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics for bf16 inputs, as HF and torchtitan do.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(positions_L: torch.Tensor, dim: int, theta: float, dtype: torch.dtype, scaling=None):
    """cos and sin of shape [L, dim] for the HF "rotate half" convention (so HF weights load unchanged).
    `scaling`: a RopeScalingConfig; kind "yarn" blends interpolated and original frequencies and scales cos/sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions_L.device, dtype=torch.float32) / dim))
    attention_factor = 1.0
    if scaling is not None and scaling.kind == "yarn":
        inv_freq, attention_factor = _yarn(inv_freq, dim, theta, scaling)
    freqs_LF = positions_L.float()[..., None] * inv_freq  # positions [B, L] (packed sequences): [B, L, dim]
    emb = torch.cat([freqs_LF, freqs_LF], dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s):
    """YaRN (arXiv 2309.00071) as HF's "yarn" rope type computes it: frequencies rotating fewer than beta_slow
    times over the original context are interpolated by `factor`, those above beta_fast kept, a ramp between."""
    def correction_dim(rotations):
        return dim * math.log(s.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if high == low:  # as transformers: a range that collapsed (or is reversed, for short original contexts)
        high += 0.001  # keeps its sign, so a reversed one keeps every original frequency
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)
    keep = 1 - ramp.clamp(0, 1)  # 1 = keep the original (extrapolated) frequency
    inv_freq = inv_freq / s.factor * (1 - keep) + inv_freq * keep
    if s.mscale and s.mscale_all_dim:
        attention_factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(s.factor)
    return inv_freq, attention_factor


def apply_rope(x_BHLD: torch.Tensor, cos_LD: torch.Tensor, sin_LD: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHLD.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_BHLD * cos_LD + rotated * sin_LD


def _tanh_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# transformers' ACT2FN by name, computed the way transformers computes each (the parameter-free ones; prelu and
# xielu learn parameters and are refused by ModelConfig.hidden_act).
HIDDEN_ACTS = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu,
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_new": _tanh_gelu, "gelu_accurate": _tanh_gelu, "gelu_python_tanh": _tanh_gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10, 10), "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu, "relu2": lambda x: torch.square(F.relu(x)), "relu6": F.relu6, "leaky_relu": F.leaky_relu,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "mish": F.mish, "hardswish": F.hardswish,
    "laplace": lambda x: 0.5 * (1.0 + torch.erf((x - 0.707107) / (0.282095 * math.sqrt(2.0)))),
    "linear": lambda x: x,
}


def gated(act_name: str):
    """The gated unit act(gate) * up for a ModelConfig.hidden_act name.

        gated("gelu")(gate_NF, up_NF)   # == F.gelu(gate_NF) * up_NF
    """
    act = HIDDEN_ACTS[act_name]
    return lambda gate, up: act(gate) * up


class SwiGLU(nn.Module):
    """Dense gated feed-forward: down(act(gate(x)) * up(x)), act = silu unless `act` names another
    (ModelConfig.hidden_act). Also used for shared experts.

        ffn = SwiGLU(64, 256, act="gelu"); y_BLD = ffn(x_BLD)
    """

    def __init__(self, dim: int, hidden: int, act: str = "silu"):
        super().__init__()
        self.act = HIDDEN_ACTS[act]
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
