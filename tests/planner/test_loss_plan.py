"""The plan's logits term follows backend.loss: the whole logits for `full`, one chunk plus the head's gradients
for the fused loss, which then no longer grows with the micro batch's logits."""
from moelab.config import load_config
from moelab.planner.loss import chunk_tokens, logits_bytes
from moelab.planner.plan import plan

MB4 = ("train.micro_batch_size=4", "train.global_batch_size=16")


def _logits(*overrides):
    return plan(load_config("qwen3-moe-30b-a3b-proxy", ["train.compile=true", *overrides]), gpus=1).memory["logits"]


def test_fused_loss_counts_one_chunk_not_the_whole_logits():
    cfg = load_config("qwen3-moe-30b-a3b-proxy", ["train.compile=true", "backend.loss=chunked"])
    V, D, L = cfg.model.vocab_size, cfg.model.hidden_size, cfg.train.seq_len
    T = cfg.train.micro_batch_size * L
    full, fused = _logits("backend.loss=full"), _logits("backend.loss=chunked")
    assert full == T * V * 2  # bf16 logits, their gradient written over them (moelab.backends.loss_kernel)
    tp2 = plan(load_config("qwen3-moe-30b-a3b-proxy", ["train.compile=true", "backend.loss=full", "parallel.tp=2"]),
               gpus=2).memory["logits"]
    assert tp2 == T * V * 2 * 2 // 2  # TP: the sharded loss keeps the logits and their gradient, a tp-th each
    assert fused == logits_bytes(cfg, T, 2) < full * 0.8
    C = chunk_tokens(V, T)
    assert fused >= C * V * 2 * 2 + V * D * 4  # the chunk's logits and gradient, the fp32 head gradient
    # doubling the micro batch doubles full's term; the fused loss's grows only by the hidden gradient
    full4, fused4 = _logits("backend.loss=full", *MB4), _logits("backend.loss=chunked", *MB4)
    assert full4 == 2 * full and fused4 - fused == T * D * 2
    assert "fused linear + cross-entropy" in " ".join(
        plan(load_config("qwen3-moe-30b-a3b-proxy"), gpus=1).assumptions)  # eager: auto is the chunked loss


def test_auto_loss_is_the_full_loss_where_it_is_compiled_on_cuda_and_fits_else_the_chunked_one():
    from moelab.planner.plan import AUTO_FULL_SHARE, plan, resolve_loss

    cfg = load_config("qwen3-moe-30b-a3b-proxy", ["train.compile=true", "train.dtype=bfloat16",
                                                 "train.param_dtype=bfloat16"])
    assert cfg.backend.loss == "auto"
    assert resolve_loss(cfg, 1, 141.0) == "full"                      # the H200 the speed was measured on
    assert resolve_loss(cfg, 1, 141.0, on_cuda=False) == "chunked"    # CPU
    assert resolve_loss(cfg.replace(**{"train.compile": False}), 1, 141.0) == "chunked"  # eager: fp32 logits
    full = plan(cfg.replace(**{"backend.loss": "full"}), gpus=1, gpu_memory_gb=141.0).memory_per_gpu_bytes / 2**30
    tight = full / AUTO_FULL_SHARE * 0.99                              # the full loss's plan just over 85%
    assert resolve_loss(cfg, 1, tight * 1.02) == "full"
    # short of memory: the one that plans less (the full loss on a tie: one micro batch, its logits under the
    # gradients' peak)
    chunked = plan(cfg.replace(**{"backend.loss": "chunked"}), gpus=1, gpu_memory_gb=tight).memory_per_gpu_bytes
    assert resolve_loss(cfg, 1, tight) == ("full" if full * 2**30 <= chunked else "chunked")
    many = cfg.replace(**{"train.global_batch_size": 16})  # 8 micro batches: every term adds, the logits too
    full16 = plan(many.replace(**{"backend.loss": "full"}), gpus=1, gpu_memory_gb=141.0).memory_per_gpu_bytes / 2**30
    assert resolve_loss(many, 1, full16 / AUTO_FULL_SHARE * 0.99) == "chunked"
    for kind in ("chunked", "full"):                                  # a setting other than auto stands
        assert resolve_loss(cfg.replace(**{"backend.loss": kind}), 1, 1.0) == kind
    # the plan of auto is the plan of what it resolves to
    assert plan(cfg, gpus=1, gpu_memory_gb=tight).memory == plan(
        cfg.replace(**{"backend.loss": resolve_loss(cfg, 1, tight)}), gpus=1, gpu_memory_gb=tight).memory


def test_cut_cross_entropy_keeps_no_logits_and_grows_only_by_the_hidden_gradient():
    """backend.loss=cce forms both gradients in backward, blockwise: the head's gradient in the compute dtype (and
    its fp32 copy for fp32 weights) and the hidden gradient; no chunk of logits, no fp32 accumulator for a bf16
    head (the fused chunked loss keeps one)."""
    bf16 = ("train.dtype=bfloat16", "train.param_dtype=bfloat16")
    cfg = load_config("qwen3-moe-30b-a3b-proxy", ["train.compile=true", "backend.loss=cce", *bf16])
    V, D, T = cfg.model.vocab_size, cfg.model.hidden_size, cfg.train.micro_batch_size * cfg.train.seq_len
    cce, chunked = _logits("backend.loss=cce", *bf16), _logits("backend.loss=chunked", *bf16)
    assert V * D * 2 < cce < chunked - V * D * 2  # the bf16 head gradient, not the fp32 accumulator
    assert _logits("backend.loss=cce", *bf16, *MB4) - cce == T * D * 2 + T * 4  # the hidden gradient and the LSE
    assert _logits("backend.loss=cce", "train.dtype=bfloat16") - cce == V * D * 4  # an fp32 head's gradient
    assert "cut cross-entropy" in " ".join(plan(cfg, gpus=1).assumptions)
