"""The loss's memory: the logits term of the plan for each backend.loss, and the chunk size the chunked loss uses.

Shapes: T tokens of a micro batch on this rank, V vocabulary, D hidden, C tokens per chunk; `a` bytes per element
of the compute dtype.

    chunk_tokens(151_936, 8192)            # 1024: the chunk the fused loss takes at Qwen3's vocabulary
    logits_bytes(cfg, T=8192, a=2)        # bytes the loss holds at its peak (the plan's "logits" term)

- full: the whole logits [T, V] and their gradient (compiled on a GPU: compute dtype both; eager: the logits, fp32
  log-probabilities, fp32 gradient and the gradient of the upcast, a + 12 bytes per logit).
- chunked (moelab.backends.loss): one chunk's logits in the compute dtype, their fp32 upcast and fp32 gradient, and
  the gradient in the compute dtype (C x V x (2a + 8); compiled, inductor fuses the fp32 passes: C x V x 2a), plus
  what its forward keeps for backward: the weight gradient [V, D] (accumulated in fp32, kept in the weight's
  dtype: fp32 and bf16 copies side by side for a moment) and the hidden gradient [T, D].
- liger: counted like chunked (Liger Kernel's fused loss accumulates the head's gradient in fp32 over its own
  small chunks, computed in forward, as chunked does).
- cce (Apple's cut-cross-entropy): keeps no logits and computes both gradients in backward, blockwise: the head's
  gradient in the compute dtype (and its fp32 copy for fp32 weights), the hidden gradient, the fp32 log-sum-exp.
"""
from __future__ import annotations

# The chunked loss's default chunk: the largest power of two whose fp32 logits stay within 2**30 bytes (1 GiB):
# about 1024 tokens at a 150k vocabulary, the whole micro batch at small vocabularies. Large enough that the weight
# gradient's accumulation (V x D per chunk) stays small next to the chunk's matmuls (2 C V D flops).
CHUNK_LOGIT_BYTES = 2**30


def chunk_tokens(vocab_size: int, tokens: int, setting: int = 0) -> int:
    """Tokens per chunk of the chunked loss: `setting` (backend.loss_chunk_tokens) when > 0, else the default
    above; never more than `tokens`."""
    if setting > 0:
        return max(1, min(setting, tokens))
    c = 1
    while 2 * c * vocab_size * 4 <= CHUNK_LOGIT_BYTES:
        c *= 2
    return max(1, min(c, tokens))


def in_place(cfg, full_loss: str = "kernel") -> bool:
    """Whether backend.loss=full runs its in-place kernel (moelab.backends.loss_kernel: the logits' gradient written
    over them) under the code planned (`full_loss`, Plan.full_loss): on a GPU, without tensor parallelism (whose loss
    takes the sharded logits)."""
    return cfg.backend.loss == "full" and full_loss == "kernel" and cfg.parallel.tp == 1


def logits_bytes(cfg, T: int, a: int, full_loss: str = "kernel") -> int:
    """Peak bytes of the loss on the last pipeline stage for a micro batch of T tokens (the plan's logits term);
    the chunked loss's weight gradient counts its fp32 accumulator and its copy in the weight's dtype; `full_loss`:
    the code planned (``in_place``)."""
    V, D, compiled = cfg.model.vocab_size, cfg.model.hidden_size, cfg.train.compile
    if in_place(cfg, full_loss):
        return T * V * a
    if cfg.backend.loss == "full":
        return T * V * (2 * a if compiled else a + 12)
    if cfg.backend.loss == "cce":
        return V * D * (a + (4 if cfg.train.param_dtype == "float32" else 0)) + T * D * a + 4 * T
    C = chunk_tokens(V, T, cfg.backend.loss_chunk_tokens)
    head_bf16 = cfg.train.param_dtype == "bfloat16" or (cfg.train.dtype == "bfloat16"
                                                         and cfg.parallel.data_parallel == "fsdp")
    # during the chunks: one chunk's logits work next to the fp32 weight gradient; after them, the fp32 gradient
    # and its copy in a bf16 head's dtype (the chunk's buffers are gone by then)
    chunk = C * V * (2 * a if compiled else 2 * a + 8)
    return V * D * 4 + T * D * a + max(chunk, V * D * a if head_bf16 else 0)


def loss_assumption(cfg, full_loss: str = "kernel") -> str:
    """The plan's line on the loss term."""
    t, b = cfg.train, cfg.backend
    if in_place(cfg, full_loss):
        return "full loss (CUDA): the logits, their gradient written over them (moelab.backends.loss_kernel)"
    if b.loss == "full":
        return ("loss compiled (CUDA): logits and their gradient only" if t.compile else
                "eager loss: logits, fp32 log-probabilities and fp32 gradients (compute-dtype bytes + 12 per logit)")
    if b.loss == "cce":
        return ("cut cross-entropy (backend.loss=cce): no logits kept; the head's and the hidden gradient formed "
                "in backward")
    return (f"fused linear + cross-entropy (backend.loss={b.loss}): one chunk of logits at a time "
            f"({'backend.loss_chunk_tokens=' + str(b.loss_chunk_tokens) if b.loss_chunk_tokens else 'auto chunk'}), "
            "plus the fp32 LM-head gradient and the hidden gradient its forward computes")
