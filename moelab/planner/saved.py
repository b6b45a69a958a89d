"""What autograd keeps from a block's forward to its backward, in bytes per token: the planner's activation term,
counted tensor by tensor from moelab.model as it runs eager and as torch.compile partitions it (train.compile).

    saved_per_token(cfg, moe=True, a=2)      # {"attention": ..., "ffn": ..., "input": ...} for one block

Letters as in docs/shapes.md; `a` bytes per element of the compute dtype. Attention kernels (SDPA's flash /
memory-efficient / cuDNN paths, FlexAttention) keep q, k, v, their output and the fp32 log-sum-exp; the output is
laid out [B, L, H, Dv], so the output projection reads it without a copy.

Eager (every op keeps what its backward formula reads):
- RMSNorm keeps its fp32 upcast and the normalised value before the weight (D x (4 + a)); its output is kept by
  the matmuls that read it (attention: q/k/v, MLA's latents; FFN: a dense or shared-expert MLP, and the router, which
  keeps it in the stream's dtype: an fp32 stream's value, not autocast's bf16 copy; not the routed rows, gathered
  by index).
- GQA: q/k norms as RMSNorm (Qwen3), the kernel's q, k, v, output and LSE; sinks (GPT-OSS) scale the output by an
  fp32 sigmoid, so the output projection reads a new tensor. MLA: the q and kv latent norms, the kernel's q and k
  (concatenated nope | rope parts), the whole kv_b projection (v is a view of it), the output and LSE.
- MoE (LocalDispatcher): the routed rows x_ND, gate|up h_NF2, the activation's saved values (SwiGLU: silu(gate);
  GPT-OSS's clamped SwiGLU: the clamped gate, the sigmoid, their product and up + 1), the down projection's input
  (the activation weighted by the routing weights); the rows move by gathers (moelab.model.rows), which keep only
  their indices; a learned router also keeps its fp32 input and scores, and the activation before its weighting for
  the gradient of the routing weights. The fake balanced gate's weights are constants: its router keeps nothing.
  Expert parallelism weights the expert output at combine instead (the weights stay on the source rank): the
  combine keeps the returned rows for the weights' gradient, and the exchange's two index_copy sources (the expert
  output unsorted, the received rows put back rank-major).
- SwiGLU MLPs (dense, shared experts): gate and up outputs, silu(gate) and their product.
- On-tokens experts (backend.experts=triton_fused | sonic, eager or compiled alike: opaque kernels): the tokens
  they read (the FFN norm's output), gate|up per routed row and its routing metadata (ON_TOKENS); no routed copy
  of the rows, no activation, no dispatch indices (the activation is made again in backward).
Compiled (inductor's min-cut partitioner: pointwise work is recomputed in backward, matmul and kernel inputs are
kept): the block input, the normalised inputs of matmuls, the residual before the FFN norm, q/k before their
norms, MLA's latents before and after their norms, the kernel's q, k, v (MLA: the kv_b projection) and output
(sinks: the scaled output too), gate|up and the weighted activation (the down projection's input), the routed
rows (the routing weights' gradient recomputes the activation from gate|up); the router's scores (its input
recomputed from the kept residual). Expert parallelism's exchanges run outside the compiled graph (host split
sizes): the two index_copy sources of the way back are kept eagerly, and with a learned router the expert output
for the routing weights' gradient.
Context parallelism (sdpa): each query chunk's kernel keeps the gathered keys and values up to its end, repeated
to every query head, and the two chunk outputs are concatenated (a second copy of the output).
Frozen weights (train.lora, a frozen router): a matmul whose weight does not train keeps no input (only the
weight, for its input's gradient), a frozen norm weight no normalised value; each LoRA adapter keeps x A.
Autocast over fp32 weights on one rank keeps the residual stream, and so the norms' normalised values, in fp32.

Both were checked tensor by tensor against the real blocks (every preset proxy's MoE and dense blocks, eager and
through the inductor partitioner, on CPU with a kernel that keeps what the GPU kernels keep): within 1% per block;
tests/planner/test_saved.py checks small configs against the saved tensors of the real model.
"""
from __future__ import annotations

from moelab.config import Config
from moelab.config.lora import lora_modules_present, resolve_lora_targets


def _norm_eager(width: int, a: int, output_kept: bool, weight_trains: bool = True, r: int = 0) -> int:
    """An RMSNorm of `width` run eagerly: fp32 upcast, the normalised value in its input's dtype (`r` bytes, the
    residual stream's; 0: `a`) for its weight's gradient, and its output (`a` bytes) when a matmul reads it."""
    return width * (4 + (r or a) * weight_trains + a * output_kept)


def trained_inputs(cfg: Config):
    """A predicate over the model's matmul groups (train.lora.targets names, and "router"): whether a matmul
    trains a weight (or a LoRA adapter) from its input, so that autograd keeps the input; a frozen weight's
    matmul needs only the weight for its input's gradient. Full training: every group but a frozen or fake
    router; LoRA: its targets (and the router with train.lora.train_router)."""
    lo, k = cfg.train.lora, cfg.model.moe
    router = not cfg.backend.fake_balanced_gate and not k.freeze_router and (lo.train_router or not lo.rank)
    if not lo.rank:  # "norms": the RMSNorm weights
        return lambda name: router if name == "router" else True
    targets = set(resolve_lora_targets(cfg.model, lo.targets)) | ({"router"} if router else set())
    return lambda name: name in targets


def _adapters(cfg: Config, names) -> int:
    """LoRA: each adapter keeps its input times A (rank R per token) for B's gradient; `names` the modules."""
    lo = cfg.train.lora
    return 0 if not lo.rank else lo.rank * sum(n in set(resolve_lora_targets(cfg.model, lo.targets)) for n in names)


def _attention(cfg: Config, a: int, compiled: bool, eager_path: bool, r: int) -> int:
    m, trained = cfg.model, trained_inputs(cfg)
    D, H = m.hidden_size, m.num_heads
    if m.attention == "mla":
        Q, C, Dr, Dn, Dv = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
        d_qk = Dn + Dr
        xn = trained("q_a_proj" if Q else "q_proj") or trained("kv_a_proj")  # the matmuls reading the norm
        q_b, kv_b = bool(Q) and trained("q_b_proj"), trained("kv_b_proj")  # and reading the latents' norms
        kernel = a * (2 * H * d_qk + H * (Dn + Dv) + H * Dv) + 4 * H  # q, k, the kv_b projection, output; LSE
        # k and the kv_b projection gathered instead (auto is sdpa under context parallelism)
        if cfg.parallel.cp > 1 and cfg.backend.attention in ("sdpa", "auto"):
            kernel += _context_parallel_extra(cfg, a, d_qk, Dv) - a * H * (d_qk + Dn + Dv)
        if compiled:  # x, xn; q latent before its norm and after; kv latent (with the rope key) and after its norm
            out = a * D * (1 + xn) + a * (Q + q_b * Q + (C + Dr) + kv_b * C) + kernel
        else:
            nw = trained("norms")
            out = _norm_eager(D, a, xn, nw, r) + (_norm_eager(Q, a, q_b, nw) if Q else 0) \
                + _norm_eager(C, a, kv_b, nw) + kernel
        kv_heads = H
    else:
        G, Dh = m.num_kv_heads, m.head_dim
        xn = any(trained(n) for n in ("q_proj", "k_proj", "v_proj"))
        kernel = a * (H + 2 * G) * Dh + a * H * Dh + 4 * H  # q, k, v, output; LSE
        if cfg.parallel.cp > 1 and cfg.backend.attention in ("sdpa", "auto"):
            kernel += _context_parallel_extra(cfg, a, Dh, Dh) - 2 * a * G * Dh
        sinks = 0  # sinks scale the output by an fp32 sigmoid: the output projection reads a new tensor
        if m.attention_sinks:
            sinks = a * H * Dh * trained("o_proj") + (0 if compiled else (4 + a) * H)
        if compiled:  # x, xn, q and k before their norms
            out = a * D * (1 + xn) + (a * (H + G) * Dh if m.qk_norm else 0) + kernel + sinks
        else:
            qk_norm = _norm_eager((H + G) * Dh, a, False, trained("norms")) if m.qk_norm else 0
            out = _norm_eager(D, a, xn, trained("norms"), r) + qk_norm + kernel + sinks
        d_qk = Dh
        kv_heads = G
    attention = [n for n in lora_modules_present(m) if n not in ("dense_mlp", "shared_experts", "experts")]
    out += a * _adapters(cfg, attention)
    if eager_path:  # moelab's reference path materialises the scores (fp32 probabilities and their copy) ...
        out += H * cfg.train.seq_len // cfg.parallel.cp * (4 + a)
        if m.attention != "mla":  # ... and repeats k and v to every query head
            out += 2 * a * (H - kv_heads) * d_qk
    return out


def _context_parallel_extra(cfg: Config, a: int, d_qk: int, d_v: int) -> int:
    """Context parallelism (moelab.parallel.context): each of a rank's two query chunks attends to the gathered
    keys up to its end, repeated to every query head, and its output is a new tensor before the two are
    concatenated: k and v of H heads for (2 cp + 1) / 2 keys per local token, and a second output."""
    H, cp = cfg.model.num_heads, cfg.parallel.cp
    return a * H * (d_qk + d_v) * (2 * cp + 1) // 2 + a * H * d_v


def _swiglu_mlp(width: int, a: int, compiled: bool, trained: bool) -> int:
    """A SwiGLU MLP of `width` beyond its input: gate and up outputs (the activation's inputs), silu(gate) when
    eager, and the down projection's input when its weight trains."""
    return a * width * (2 + (not compiled) + trained)


# Where the local dispatcher applies the routing weights, by the code planned: "experts" (moelab's: before the
# down projection, rows moved by gathers) or "combine" (before a3f8c38: the expert outputs weighted at combine and
# kept for the weights' gradient, unsorted by index_copy), for records measured with that code.
LOCAL_WEIGHTING = ("experts", "combine")

# The experts backends that read the tokens themselves (backend.experts; moelab.model.fused_experts,
# moelab.backends.sonic): no routed copy of the rows, the activation remade in backward. Per routed row they keep
# gate|up (2F in the compute dtype) and ON_TOKENS_ROW_BYTES of routing metadata: the fp32 routing weight and two
# int32 row indices (triton_fused: token and assignment; SonicMoE: its gather, scatter and reverse-scatter
# indices, the weight being the router's own output); per token, bytes besides (SonicMoE: its int32 per-token
# offsets). The tokens themselves are the FFN norm's output, counted with the norm.
ON_TOKENS = {"triton_fused": 0, "sonic": 4}
ON_TOKENS_ROW_BYTES = 12


def on_tokens_experts(cfg: Config, a: int) -> int:
    """Bytes per token an on-tokens experts backend (ON_TOKENS) keeps besides the tokens it reads: what
    gallery/scripts/gpu_moe_layer.py measures as the layer's saved activations."""
    k = cfg.model.moe
    return k.top_k * (a * 2 * k.expert_ffn_size + ON_TOKENS_ROW_BYTES) + ON_TOKENS[cfg.backend.experts]


def _ffn(cfg: Config, moe: bool, a: int, compiled: bool, r: int, weighting: str = "experts") -> int:
    m, k, trained = cfg.model, cfg.model.moe, trained_inputs(cfg)
    D = m.hidden_size
    if not moe:
        mlp = trained("dense_mlp")
        norm = a * D * (1 + mlp) if compiled else _norm_eager(D, a, mlp, trained("norms"), r)  # compiled: h, xn
        return norm + _swiglu_mlp(m.dense_ffn_size, a, compiled, mlp) + 3 * a * _adapters(cfg, ["dense_mlp"])
    K, E, F = k.top_k, k.num_experts, k.expert_ffn_size
    shared, shared_mlp = k.num_shared_experts * F, bool(k.num_shared_experts) and trained("shared_experts")
    learned, experts_in = not cfg.backend.fake_balanced_gate, trained("experts")
    # the input of a router that trains, in the stream's dtype (moelab.model.router.router_logits); none extra where
    # the stream is in the compute dtype and either a shared expert's matmul keeps the same tensor or inductor
    # recomputes it from the kept residual (an fp32 stream under autocast: the router keeps its own fp32 value)
    on_tokens = cfg.backend.experts in ON_TOKENS
    router = r * D if trained("router") and not (r == a and (shared_mlp or compiled or on_tokens)) else 0
    router += 8 * E + 28 * K + a * K * (not compiled) if learned else 16 * K
    mlp = _swiglu_mlp(shared, a, compiled, shared_mlp) if shared else 0
    if on_tokens:  # the kernels keep the tokens they read (the norm's output), gate|up and the rows' metadata
        norm = a * D * 2 if compiled else _norm_eager(D, a, True, trained("norms"), r)  # compiled: h, xn
        cast = a * D if r != a and shared_mlp and not compiled else 0  # autocast: the MLP's and kernels' copies
        return norm + cast + router + on_tokens_experts(cfg, a) + mlp
    rows = K * a * (2 * F + (D + F) * experts_in)  # gate|up; routed rows and the down projection's input
    at_combine = cfg.parallel.ep > 1 or weighting == "combine"  # the expert output weighted after the experts
    if cfg.parallel.ep > 1:  # the expert output for the routing weights' gradient; the exchange's way back
        back = K * a * D * (learned + (2 if compiled else 1))
    elif at_combine:  # the expert output for the routing weights' gradient
        back = K * a * D * learned
    else:  # the activation before its weighting, for the weights' gradient (compiled: recomputed from gate|up)
        back = 0 if compiled else K * a * F * learned
    if compiled:
        norm = a * D * (1 + shared_mlp)  # the residual (and xn where a shared expert's matmul trains from it)
        experts = rows + back
    else:
        norm = _norm_eager(D, a, shared_mlp, trained("norms"), r)
        act = 4 if k.activation == "gpt_oss" else 1  # the activation's saved values, in units of F
        # ... and under EP the expert output, the source of the index_copy that unsorts it (the local dispatcher's
        # unsort is a gather both ways, moelab.model.rows: nothing kept)
        experts = rows + K * a * (act * F + D * at_combine) + back
    bias = 9 * K if k.expert_proj_bias else 0  # each row's expert index for its bias, and whether it is a kept row
    lora = a * (2 * K * _adapters(cfg, ["experts"]) + 3 * _adapters(cfg, ["shared_experts"]))
    return norm + router + experts + bias + lora + mlp


def saved_per_token(cfg: Config, moe: bool, a: int, eager_attention: bool = False, residual: int = 0,
                    weighting: str = "experts") -> dict:
    """Bytes per token one block keeps for backward ({"attention", "ffn"}) and its input ("input": what full
    checkpointing keeps), for a MoE block (`moe`) or a dense one, eager or compiled as cfg.train.compile says;
    `eager_attention`: the block's attention takes moelab's reference path (moelab.model.attention);
    `residual`: bytes per element of the residual stream when not `a` (4: autocast over fp32 weights, where the
    embedding and every residual add stay fp32 and the norms normalise in fp32); `weighting`: LOCAL_WEIGHTING."""
    compiled, r = cfg.train.compile, residual or a
    return {"attention": _attention(cfg, a, compiled, eager_attention, r),
            "ffn": _ffn(cfg, moe, a, compiled, r, weighting), "input": r * cfg.model.hidden_size}
