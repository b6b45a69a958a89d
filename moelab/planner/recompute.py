"""Activation memory of one rank's layers under each train.activation_checkpointing choice, split into what is
held from forward to backward for every micro batch in flight and the working set of the one block being
recomputed (a pipeline rank runs one backward at a time, so only one recompute working set exists):

    activations = in_flight * held + working

- none: every block's saved tensors are held; nothing is recomputed.
- full: each block's input is held; one block's saved tensors are rebuilt at a time (the largest).
- selective (moelab.model.recompute): each block holds its inputs, the outputs of its matmuls and fused
  attention kernel, and the router's saved tensors and choices; the rest of one block (norms, rotary,
  SwiGLU products, dispatch copies, the eager path's scores) is rebuilt at a time.

    held, working = layer_activations(cfg, acts, layers, is_moe, a)["selective"]
"""
from __future__ import annotations

from moelab.config import Config


def selective_kept_per_token(cfg: Config, moe: bool, a: int, fused_attention: bool) -> int:
    """Bytes per token one block keeps under selective recompute (compute dtype `a` bytes per element)."""
    m, k = cfg.model, cfg.model.moe
    D, H = m.hidden_size, m.num_heads
    if m.attention == "mla":
        d_qk, d_v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        q = (m.q_lora_rank + H * d_qk) if m.q_lora_rank else H * d_qk
        proj = q + m.kv_lora_rank + m.qk_rope_head_dim + H * (m.qk_nope_head_dim + d_v)
        out = H * d_v
    else:
        proj, out = m.head_dim * (m.num_heads + 2 * m.num_kv_heads), H * m.head_dim
    # block input, the q/k/v projections, the kernel's output and log-sum-exp, the output projection
    attn = a * (D + proj + D) + ((a * out + 4 * H) if fused_attention else 0)
    ffn_in = 2 * a * D  # the attention residual h (input of the norm) and the normalised xn
    if not moe:
        return attn + ffn_in + a * (2 * m.dense_ffn_size + D)  # gate, up and down projections
    K, F = k.top_k, k.expert_ffn_size
    router = (4 * D if a < 4 else 0) + 4 * k.num_experts + 16 * K  # fp32 input copy, scores, choices
    route = K * (a + 8)  # the kept combine weights and expert indices
    experts = K * a * (2 * F + D)  # grouped GEMM outputs: gate|up and down
    shared = a * (2 * F + D) * k.num_shared_experts if k.num_shared_experts else 0
    return attn + ffn_in + router + route + experts + shared


def layer_activations(cfg: Config, acts: list[dict], kept: list[int], layers: list[int], T: int) -> dict:
    """{mode: (held, working)} bytes for one micro batch of T tokens through `layers`; `acts[i]` is layer i's
    saved bytes per token by part (moelab.planner.saved.saved_per_token), `kept[i]` its selective bytes."""
    saved = [acts[i]["attention"] + acts[i]["ffn"] for i in layers]
    sel = [min(kept[i], s) for i, s in zip(layers, saved)]
    return {
        "none": (T * sum(saved), 0),
        "selective": (T * sum(sel), T * max((s - k for s, k in zip(saved, sel)), default=0)),
        "full": (T * sum(acts[i]["input"] for i in layers), T * max(saved, default=0)),
    }
