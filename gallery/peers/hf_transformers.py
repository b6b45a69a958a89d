"""Peer: Hugging Face transformers' Qwen3MoeForCausalLM at moelab's preset shapes, trained in a plain loop.

    python gallery/peers/hf_transformers.py --experts grouped_mm --json out.json

bf16 parameters, SDPA attention, fused AdamW, the model's own loss (labels=), experts_implementation as given
(eager = a Python loop over experts; grouped_mm = torch._grouped_mm)."""
from __future__ import annotations

import torch

from common import model_config, parser, random_batches, result, run_batches


def build(m, experts: str):
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_cfg = Qwen3MoeConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.dense_ffn_size,
        moe_intermediate_size=m.moe.expert_ffn_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
        num_experts=m.moe.num_experts, num_experts_per_tok=m.moe.top_k, norm_topk_prob=m.moe.norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[], rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings, max_position_embeddings=32768, output_router_logits=False,
        attn_implementation="sdpa", experts_implementation=experts, use_cache=False)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts)
    model.train()
    return model, transformers.__version__


def main():
    ap = parser(__doc__)
    ap.add_argument("--experts", default="grouped_mm", help="experts_implementation: eager | grouped_mm | batched_mm")
    args = ap.parse_args()
    m = model_config(args)
    model, version = build(m, args.experts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    batches = random_batches(args, m.vocab_size)
    if args.compile:
        raise SystemExit("hf_transformers.py: --compile is not measured for this peer (run it eager)")

    def make_step(micro):
        def step(i):
            for j in range(micro):
                ids = batches[(i * micro + j) % len(batches)]
                out = model(input_ids=ids[:, :-1], labels=ids[:, :-1])
                (out.loss / micro).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    run_batches(args, make_step, lambda gbs, times, error=None: result(
        "hf-transformers", f"experts_implementation={args.experts}", args, times,
        {"transformers_version": version, "experts_implementation": args.experts}, gbs=gbs, error=error))


if __name__ == "__main__":
    main()
