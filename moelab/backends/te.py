"""Transformer Engine backends: experts as TE GroupedLinear, attention as TE DotProductAttention (with TE Linear
projections and TE RMSNorm where that pays), and TE's FP8 recipes for the attention projections.

Shapes: N routed rows sorted by expert, D hidden, F expert width, E experts; B batch, L sequence, H query heads,
G kv heads, Dh head dim (Dk for q/k and Dv for v where they differ, as in MLA).

The swap happens on the meta-device model before it is materialised, so moelab's initialisation (seeded by
parameter name) and checkpoints see ordinary parameters: TE Linear and RMSNorm keep the names `weight`/`bias`;
TE experts hold `gate_up_proj.weight{e}` [2F, D] and `down_proj.weight{e}` [D, F] per expert. GPT-OSS's sink
logits stay moelab's parameter (`attention.sinks`) and are handed to TE's learnable softmax offset per call.

Under `train.compile` every TE module runs outside the compiled graphs (``torch.compiler.disable``) while the
rest of each block stays compiled; the projections and norms then stay torch's (compiled and fused), unless a TE
FP8 recipe (`backend.te_fp8`) needs TE Linear layers.

    cfg = load_config("qwen3-moe-30b-a3b-proxy", {"backend.attention": "te", "train.compile": True})
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from moelab.backends.packages import BackendUnavailable, import_package
from moelab.backends.ops import scale_rows


def _eager(module: nn.Module) -> nn.Module:
    """Run this module's forward outside torch.compile's graphs (TE's kernels are opaque to dynamo)."""
    module.forward = torch.compiler.disable(module.forward)
    return module


def grouped_tensor_path(te) -> bool:
    """Whether TE's GroupedLinear can take the split sizes as a CUDA tensor (one cuBLASLt grouped GEMM, no host
    synchronisation): TE >= 2.20 on Hopper with cuBLASLt >= 13.4, bf16."""
    try:
        from transformer_engine.pytorch.module.grouped_linear import is_module_grouped_tensor_path_supported
        return bool(is_module_grouped_tensor_path_supported(None, torch.bfloat16))
    except Exception:  # older TE, no GPU, or a cuBLASLt query that fails: the per-expert path
        return False


class TEGroupedExperts(nn.Module):
    """Routed experts as two TE GroupedLinear layers (plain SwiGLU, no biases).

    With TE's grouped-tensor path the rows per expert stay on the device; otherwise GroupedLinear takes them as
    a Python list and this layer reads the counts on the host once per layer.

        experts = TEGroupedExperts(128, 2048, 768, device="cuda")
        y_ND = experts(x_ND, counts_E)"""

    def __init__(self, num_experts: int, dim: int, ffn: int, device="meta"):
        super().__init__()
        te = import_package("te")
        self.num_experts, self.dim, self.ffn = num_experts, dim, ffn
        self.native = torch.cuda.is_available() and grouped_tensor_path(te)
        kw = dict(bias=False, device=device, use_grouped_tensor=self.native)
        self.gate_up_proj = te.GroupedLinear(num_experts, dim, 2 * ffn, **kw)
        self.down_proj = te.GroupedLinear(num_experts, ffn, dim, **kw)

    @torch.compiler.disable
    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor, scale_N: torch.Tensor | None = None) -> torch.Tensor:
        """`scale_N`: each row's routing weight, applied before the down projection (GroupedExperts.forward)."""
        if self.native:
            # Rows past the counts (dropped by capacity) are zero (the dispatcher masks them, and their weight is
            # 0) and go to the last expert: they add nothing to its gradients and the combine ignores their output.
            splits_E = counts_E.to(torch.int64).clone()
            splits_E[-1] += x_ND.shape[0] - counts_E.sum()
            gate_NF, up_NF = self.gate_up_proj(x_ND, splits_E).chunk(2, dim=-1)
            return self.down_proj(scale_rows(F.silu(gate_NF) * up_NF, scale_N), splits_E)
        m_splits = counts_E.tolist()  # the per-expert path needs the split sizes on the host
        total = sum(m_splits)
        gate_NF, up_NF = self.gate_up_proj(x_ND[:total], m_splits).chunk(2, dim=-1)
        y = self.down_proj(scale_rows(F.silu(gate_NF) * up_NF, scale_N[:total] if scale_N is not None else None),
                           m_splits)
        if total < x_ND.shape[0]:  # rows dropped by capacity are not computed
            y = torch.cat([y, y.new_zeros(x_ND.shape[0] - total, y.shape[1])])
        return y


def softmax_type_supported(te) -> bool:
    """TE >= 2.8 has learnable softmax offsets (GPT-OSS's sinks) in DotProductAttention."""
    import inspect

    return "softmax_type" in inspect.signature(te.DotProductAttention.__init__).parameters


class TEAttentionCore(nn.Module):
    """TE's fused attention as the attention module's `attend` (q [B,H,L,Dk], k [B,G,L,Dk], v [B,G,L,Dv] ->
    o [B,H,L,Dv]): causal, optionally a sliding window of `window` keys, optionally sink logits per head.

        core = TEAttentionCore(32, 4, 128, 128)
        o_BHLD = core(q_BHLD, k_BGLD, v_BGLD)"""

    def __init__(self, num_heads: int, num_kv_heads: int, qk_dim: int, v_dim: int, window: int = 0,
                 softmax_scale: float | None = None, sinks: bool = False):
        super().__init__()
        te = import_package("te")
        kw = {}
        if sinks:
            if not softmax_type_supported(te):
                raise BackendUnavailable("backend.attention='te' with attention sinks needs Transformer Engine >= 2.8 "
                                         "(learnable softmax offsets); use backend.attention=eager or flex")
            kw["softmax_type"] = "learnable"
        self.sinks = sinks
        self.core = te.DotProductAttention(num_heads, (qk_dim, v_dim) if qk_dim != v_dim else qk_dim,
                                           num_gqa_groups=num_kv_heads, attn_mask_type="causal", qkv_format="bshd",
                                           window_size=(window - 1, 0) if window else None,
                                           softmax_scale=softmax_scale, **kw)
        if sinks:  # moelab's `sinks` parameter is the offset: TE's own copy is dropped, handed in per call
            del self.core.softmax_offset
            object.__setattr__(self.core, "softmax_offset", None)

    @torch.compiler.disable
    def forward(self, q_BHLD, k_BGLD, v_BGLD, sinks_H=None):
        B, H, L, _ = q_BHLD.shape
        if self.sinks:
            object.__setattr__(self.core, "softmax_offset", sinks_H.float())
        bshd = [t.transpose(1, 2).contiguous() for t in (q_BHLD, k_BGLD, v_BGLD)]
        o_BLHD = self.core(*bshd).view(B, L, H, -1)
        return o_BLHD.transpose(1, 2)


def te_recipe(name: str):
    """TE's FP8 recipe for `backend.te_fp8`: current (per-tensor current scaling) or block (1x128 / 128x128
    block scaling, DeepSeek-V3's)."""
    from transformer_engine.common import recipe

    if name == "current":
        return recipe.Float8CurrentScaling()
    if name == "block":
        return recipe.Float8BlockScaling()
    raise BackendUnavailable(f"backend.te_fp8={name!r}: choose off, current or block")


def fp8_forward(forward, recipe):
    """`forward` run inside TE's FP8 autocast with one recipe: the TE Linear layers it calls compute in FP8 with
    TE's scaling; everything else is unchanged (TE's scaling state lives in the modules, no host sync for the
    current and block recipes)."""
    te = import_package("te")
    autocast = getattr(te, "autocast", None)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        ctx = (autocast(enabled=True, recipe=recipe) if autocast is not None
               else te.fp8_autocast(enabled=True, fp8_recipe=recipe))
        with ctx:
            return forward(*args, **kwargs)

    return run


def _te_linear(te, old: nn.Linear) -> nn.Module:
    return te.Linear(old.in_features, old.out_features, bias=old.bias is not None, device="meta")


def _te_rmsnorm(te, old: nn.Module) -> nn.Module:
    return te.RMSNorm(old.weight.shape[0], eps=old.eps, device="meta")


def _swap_core(attn: nn.Module, core: TEAttentionCore) -> None:
    attn.te_core = core
    # attention.attend is the replaceable core; an instance attribute shadows the method. The sinks are read
    # from the attention module at call time (FSDP2 swaps in the unsharded parameter during forward). Packed
    # documents never reach it: moelab.config refuses data.sft_packing with backend.attention='te'.
    object.__setattr__(attn, "attend", lambda q, k, v, documents_BL=None: attn.te_core(q, k, v, attn.sinks))


def apply_te(model: nn.Module, cfg, experts: bool, attention: bool) -> None:
    """Replace experts and/or attention modules of a meta-device MoETransformer with TE modules, in place."""
    te = import_package("te")
    compiled, fp8 = cfg.train.compile, cfg.backend.te_fp8
    recipe = te_recipe(fp8) if attention and fp8 != "off" else None
    for block in model.layers.values():
        if attention:
            attn = block.attention
            if cfg.model.attention == "mla":
                qk_dim = attn.nope_dim + attn.rope_dim
                _swap_core(attn, TEAttentionCore(attn.num_heads, attn.num_heads, qk_dim, attn.v_dim,
                                                 softmax_scale=attn.softmax_scale))
            else:
                # Projections and norms become TE's in eager runs (fused kernels) and wherever a TE FP8 recipe
                # needs them; compiled runs keep torch's, which inductor fuses with their neighbours.
                if not compiled or recipe is not None:
                    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                        lin = _te_linear(te, getattr(attn, name))
                        setattr(attn, name, _eager(lin) if compiled else lin)
                if not compiled:
                    for owner, name in ((block, "attention_norm"), (block, "ffn_norm"), (attn, "q_norm"),
                                        (attn, "k_norm")):
                        if getattr(owner, name, None) is not None:
                            setattr(owner, name, _te_rmsnorm(te, getattr(owner, name)))
                _swap_core(attn, TEAttentionCore(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.head_dim,
                                                 attn.window, sinks=attn.sinks is not None))
            if recipe is not None:  # an instance attribute: parameter names (and checkpoints) stay the same
                attn.forward = fp8_forward(attn.forward, recipe)
        if experts and block.is_moe:
            old = block.ffn.experts
            block.ffn.experts = TEGroupedExperts(old.num_experts, old.dim, old.ffn)
    if attention and not compiled and getattr(model, "norm", None) is not None:
        model.norm = _te_rmsnorm(te, model.norm)
