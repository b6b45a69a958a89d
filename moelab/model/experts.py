"""Routed experts stored stacked, computed as one grouped GEMM or a reference loop; SwiGLU or GPT-OSS's
clamped SwiGLU, with optional per-expert biases (GPT-OSS).

Shapes: N routed rows (tokens x top-k, sorted by expert), D hidden, F expert width, E local experts.
Weights: w_gate_up_EDF2 = [gate | up] of every expert, w_down_EFD; biases b_gate_up_EF2, b_down_ED.
LoRA (moelab.model.lora adds them): per-expert adapters beside each, applied by ExpertAdapters with the same
token grouping (R the rank).

Routing weights (`scale_N`, one per row; moelab.model.moe.LocalDispatcher passes them): every path scales
each row's activation before the down projection (and its down bias), y = w (a W_down + b_down), which is linear
in w: the combine then only sums, and autograd keeps no expert output for the weights' gradient. d w = <d(w a), a>
reads the activation: eager keeps it beside the weighted one (F per row instead of the output's D); compiled, the
partitioner recomputes it from the kept gate|up.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelab.backends.ops import scale_rows
from moelab.model.layers import gated


def grouped_mm_supported(x: torch.Tensor, *dims: int) -> bool:
    """torch._grouped_mm needs 16-byte aligned strides; on CUDA it needs bf16 on sm80+; on CPU, fp32 works
    eagerly (inductor's grouped_mm takes bf16 only, so a compiled fp32 run takes the loop)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    if any((d * x.element_size()) % 16 for d in dims):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 8
    return x.device.type == "cpu" and x.dtype == torch.float32


def swiglu(gate, up):
    return F.silu(gate) * up


# GPT-OSS's clamped SwiGLU constants (openai/gpt-oss; transformers' GptOssExperts swiglu_alpha/swiglu_limit).
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


def gpt_oss_glu(gate, up):
    """(up + 1) * gate * sigmoid(1.702 * gate) with gate <= 7 and |up| <= 7 (GPT-OSS experts)."""
    gate = gate.clamp(max=GPT_OSS_LIMIT)
    up = up.clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * GPT_OSS_ALPHA))


ACTIVATIONS = {"swiglu": swiglu, "gpt_oss": gpt_oss_glu}


class GroupedExperts(nn.Module):
    """E experts' SwiGLU FFNs as stacked weights (w_EDF), run on routed rows sorted by expert.

        experts = GroupedExperts(num_experts=8, dim=64, ffn=128)
        y_ND = experts(x_ND, counts_E)           # rows grouped by expert, counts_E rows each
        y_ND = experts(x_ND, counts_E, w_N)      # each row weighted by its routing weight ([N])
    """
    def __init__(self, num_experts: int, dim: int, ffn: int, impl: str = "auto", bias: bool = False,
                 activation: str = "swiglu"):
        super().__init__()
        self.num_experts, self.dim, self.ffn = num_experts, dim, ffn
        self.impl = impl  # auto | grouped_mm | loop | triton_fused, sonic (on_tokens); others: moelab.backends
        self.activation = activation
        # Global index of the first expert held here: 0, or this rank's slice under expert parallelism
        # (moelab.parallel.expert_parallel.shard_experts); init_weights seeds each expert by its global index.
        self.expert_offset = 0
        self.fp8 = False  # train.fp8='rowwise': FP8 grouped GEMMs (moelab.model.fp8_convert.enable_fp8)
        self.w_gate_up_EDF2 = nn.Parameter(torch.empty(num_experts, dim, 2 * ffn))
        self.w_down_EFD = nn.Parameter(torch.empty(num_experts, ffn, dim))
        # GPT-OSS biases; "b_" parameters start at zero (MoETransformer.init_weights).
        self.b_gate_up_EF2 = nn.Parameter(torch.empty(num_experts, 2 * ffn)) if bias else None
        self.b_down_ED = nn.Parameter(torch.empty(num_experts, dim)) if bias else None

    def compute_weights(self, x: torch.Tensor):
        """x in the compute dtype (autocast's on CUDA: torch._grouped_mm is not covered by it) and the weights and
        biases cast to it (fp32 master weights with a bf16 compute dtype)."""
        w = (self.w_gate_up_EDF2, self.w_down_EFD, self.b_gate_up_EF2, self.b_down_ED)
        if x.is_cuda and torch.is_autocast_enabled("cuda"):
            # compute in autocast's dtype, not in the fp32 residual stream's (fp32 rows would fall back to the
            # per-expert loop, ~8x slower on an H200)
            x = x.to(torch.get_autocast_dtype("cuda"))
        return x, *(t.to(x.dtype) if t is not None and t.dtype != x.dtype else t for t in w)

    def on_tokens(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, order_N: torch.Tensor | None,
                  counts_E: torch.Tensor | None, experts_TK: torch.Tensor | None = None) -> torch.Tensor:
        """backend.experts=triton_fused | sonic: y_TD = each token's K expert outputs, weighted and summed, computed
        straight from the tokens by moelab.model.fused_experts' kernels (order_N: the T*K assignments sorted by
        expert; counts_E: rows per expert) or by SonicMoE's (moelab.backends.sonic: experts_TK, each token's K
        experts; order_N and counts_E unused, may be None); every assignment kept."""
        if self.fp8 or getattr(self, "lora_rank", 0) or self.b_gate_up_EF2 is not None or self.activation != "swiglu":
            raise ValueError(f"backend.experts={self.impl!r} computes plain SwiGLU experts without biases, FP8 or "
                             "LoRA (refused by moelab.backends before a run); use backend.experts=auto")
        x_TD, w1, w2, _, _ = self.compute_weights(x_TD)
        if self.impl == "sonic":
            from moelab.backends.sonic import sonic_experts

            return sonic_experts(x_TD, weights_TK, experts_TK, w1, w2)
        from moelab.model.fused_experts import fused_experts

        return fused_experts(x_TD, weights_TK, w1, w2, order_N, counts_E)

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor, scale_N: torch.Tensor | None = None) -> torch.Tensor:
        """x_ND: rows sorted by expert; counts_E: rows per expert (rows past their sum are ignored); scale_N:
        each row's routing weight, applied before the down projection (None: unweighted rows)."""
        x_ND, w1, w2, b1, b2 = self.compute_weights(x_ND)
        lora = None
        if getattr(self, "lora_rank", 0):  # grouped LoRA (moelab.model.lora), on the torch paths only
            lora = expert_adapters(self, x_ND.dtype)
        if self.fp8:
            if lora is not None:  # refused by moelab.config.lora before a run starts
                raise ValueError("train.fp8 experts have no LoRA path; set train.fp8=off")
            from moelab.model.fp8 import fp8_experts

            return fp8_experts(self, x_ND, w1, w2, counts_E, ACTIVATIONS[self.activation], scale_N)
        impl = self.impl
        if impl in ("auto", "triton_fused", "sonic"):  # these kernels take tokens (on_tokens); sorted rows: torch's
            impl = "grouped_mm" if grouped_mm_supported(x_ND, self.dim, 2 * self.ffn) else "loop"
        if impl not in ("grouped_mm", "loop"):  # an optional package's kernel (moelab.backends)
            from moelab.backends import experts_kernel

            if lora is not None:  # refused by moelab.config.lora before a run starts
                raise ValueError(f"backend.experts={impl!r} has no LoRA path; use auto, grouped_mm or loop")
            return experts_kernel(impl, self)(x_ND, w1, w2, counts_E, scale_N)
        fn = grouped_mm_swiglu if impl == "grouped_mm" else loop_swiglu
        return fn(x_ND, w1, w2, counts_E, b1, b2, ACTIVATIONS.get(self.activation) or gated(self.activation), lora,
                  scale_N)


# the stacked adapters of GroupedExperts: (A, B) next to w_gate_up_EDF2, then next to w_down_EFD
EXPERT_ADAPTERS = (("lora_a_gate_up_EDR", "lora_b_gate_up_ERF2", "w_gate_up_EDF2"),
                   ("lora_a_down_EFR", "lora_b_down_ERD", "w_down_EFD"))


class ExpertAdapters:
    """The grouped adapters of one GroupedExperts call, in the compute dtype: ``delta(i, x_NI, counts_E, offs_E)``
    is the update of projection i (0: gate|up, 1: down) for rows grouped by expert; ``delta_expert(i, x, e)`` the
    same for the rows of expert e alone (the loop path).

        lora = expert_adapters(experts, x_ND.dtype)
        h_NF2 = h_NF2 + lora.delta(0, x_ND, counts_E, offs_E)
    """

    def __init__(self, experts: GroupedExperts, dtype: torch.dtype):
        self.a = [getattr(experts, a).to(dtype) for a, _, _ in EXPERT_ADAPTERS]
        self.b = [getattr(experts, b).to(dtype) for _, b, _ in EXPERT_ADAPTERS]
        self.scaling, self.dropout, self.training = experts.lora_scaling, experts.lora_dropout, experts.training

    def _drop(self, x):
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def delta(self, i: int, x_NI: torch.Tensor, counts_E: torch.Tensor, offs_E: torch.Tensor | None = None):
        a_EIR, b_ERO = self.a[i], self.b[i]
        x_NI = self._drop(x_NI)
        if grouped_mm_supported(x_NI, a_EIR.shape[1], a_EIR.shape[2], b_ERO.shape[2]):
            offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32) if offs_E is None else offs_E
            h_NR = torch._grouped_mm(x_NI, a_EIR, offs=offs_E)
            return torch._grouped_mm(h_NR, b_ERO, offs=offs_E) * self.scaling
        out_NO = x_NI.new_zeros(x_NI.shape[0], b_ERO.shape[2])  # one matmul pair per expert (a host sync)
        start = 0
        for e, n in enumerate(counts_E.tolist()):
            if n:
                out_NO[start:start + n] = (x_NI[start:start + n] @ a_EIR[e]) @ b_ERO[e] * self.scaling
            start += n
        return out_NO

    def delta_expert(self, i: int, x_nI: torch.Tensor, e: int) -> torch.Tensor:
        return (self._drop(x_nI) @ self.a[i][e]) @ self.b[i][e] * self.scaling


def expert_adapters(experts: GroupedExperts, dtype: torch.dtype) -> ExpertAdapters | None:
    """The grouped adapters of `experts` (None without LoRA on them)."""
    return ExpertAdapters(experts, dtype) if getattr(experts, "lora_rank", 0) else None


class _WeightedBias(torch.autograd.Function):
    """w_N * b_ED[expert_N]: each row's down bias times its routing weight (scale_rows), keeping only b, the
    expert indices and the weights for backward. The weights' gradient <g_n, b_e(n)> is read off g b^T ([N, E],
    fp32), so no gathered [N, D] bias is kept (eager) nor saved by inductor's partitioner (which keeps a gather
    whose index is used far apart, here by both biases, rather than recompute it)."""

    @staticmethod
    def forward(ctx, b_ED, expert_N, w_N):
        ctx.save_for_backward(b_ED, expert_N, w_N)
        return scale_rows(b_ED[expert_N], w_N)

    @staticmethod
    def backward(ctx, g_ND):
        b_ED, expert_N, w_N = ctx.saved_tensors
        g_ND, db_ED, dw_N = g_ND.float(), None, None
        if ctx.needs_input_grad[0]:  # summed in fp32
            db_ED = torch.zeros(b_ED.shape, dtype=torch.float32, device=b_ED.device)
            db_ED = db_ED.index_put_((expert_N,), g_ND * w_N[:, None], accumulate=True).to(b_ED.dtype)
        if ctx.needs_input_grad[2]:
            dw_N = (g_ND @ b_ED.float().t()).gather(1, expert_N[:, None])[:, 0].to(w_N.dtype)
        return db_ED, None, dw_N


def grouped_mm_swiglu(x_ND, w_gate_up_EDF2, w_down_EFD, counts_E, b_gate_up_EF2=None, b_down_ED=None, act=swiglu,
                      lora=None, scale_N=None):
    """`lora`: the experts' grouped adapters (moelab.model.lora.ExpertAdapters), added to both projections (the
    down adapter reads the same weighted activation); `scale_N`: each row's routing weight (scale_rows)."""
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    h_NF2 = torch._grouped_mm(x_ND, w_gate_up_EDF2, offs=offs_E)
    if lora is not None:
        h_NF2 = h_NF2 + lora.delta(0, x_ND, counts_E, offs_E)
    if b_gate_up_EF2 is not None:
        # expert of each row, found on the device (no host sync); rows past the counts (dropped assignments) take
        # the last expert's index but no bias: their gradient, undefined as the grouped GEMM leaves those rows,
        # must not reach that expert's bias
        rows_N = torch.arange(x_ND.shape[0], device=x_ND.device, dtype=torch.int32)
        expert_N = torch.searchsorted(offs_E, rows_N, right=True).clamp(max=counts_E.shape[0] - 1)
        h_NF2 = h_NF2 + torch.where((rows_N < offs_E[-1])[:, None], b_gate_up_EF2[expert_N], 0.0)
    gate_NF, up_NF = h_NF2.chunk(2, dim=-1)
    a_NF = scale_rows(act(gate_NF, up_NF), scale_N)
    y_ND = torch._grouped_mm(a_NF, w_down_EFD, offs=offs_E)
    if lora is not None:
        y_ND = y_ND + lora.delta(1, a_NF, counts_E, offs_E)
    if b_down_ED is not None:
        y_ND = y_ND + (b_down_ED[expert_N] if scale_N is None else _WeightedBias.apply(b_down_ED, expert_N, scale_N))
    return y_ND


def loop_swiglu(x_ND, w_gate_up_EDF2, w_down_EFD, counts_E, b_gate_up_EF2=None, b_down_ED=None, act=swiglu,
                lora=None, scale_N=None):
    """Reference: one matmul pair per expert. Reads the counts on the host (one synchronisation)."""
    out = torch.zeros_like(x_ND)
    start = 0
    for e, n in enumerate(counts_E.tolist()):
        if n:
            x = x_ND[start:start + n]
            h = x @ w_gate_up_EDF2[e]
            if lora is not None:
                h = h + lora.delta_expert(0, x, e)
            if b_gate_up_EF2 is not None:
                h = h + b_gate_up_EF2[e]
            gate, up = h.chunk(2, dim=-1)
            scale_n = scale_N[start:start + n] if scale_N is not None else None
            a = scale_rows(act(gate, up), scale_n)
            y = a @ w_down_EFD[e]
            if lora is not None:
                y = y + lora.delta_expert(1, a, e)
            out[start:start + n] = y + scale_rows(b_down_ED[e].expand_as(y), scale_n) if b_down_ED is not None else y
        start += n
    return out
