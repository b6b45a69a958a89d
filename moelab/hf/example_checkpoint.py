"""A Qwen3-MoE checkpoint made on the spot with transformers (random weights, no download), a chat tokenizer saved
beside it, and instruction data to fine-tune it on: what the fine-tuning notebook, its end-to-end test and the
gallery's fine-tuning script start from.

    folder = make_qwen3_checkpoint("ckpt/", SMALL_QWEN3)       # config.json + model.safetensors + tokenizer
    write_chats("chats.jsonl", 64)                             # {"prompt": ..., "response": ...} per line
    Session("hf:ckpt/", {"data.kind": "sft", "data.path": "chats.jsonl", "train.lora.rank": 8, ...})

The tokenizer is a small byte-level BPE trained on the chats' alphabet, with a ChatML chat template (the one
Qwen3 uses, without the think block) and ``<|im_end|>`` as its end-of-turn and end-of-sequence token.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

# A Qwen3-MoE small enough for a CPU test: a dense first layer, top-2 of 8 experts, an untied head.
SMALL_QWEN3 = dict(vocab_size=320, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                   num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4})
# Every layer shape of Qwen3-30B-A3B (the qwen3-moe-30b-a3b-proxy preset's: 8 of its 48 layers).
QWEN3_30B_A3B_PROXY = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                           num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
                           tie_word_embeddings=False, max_position_embeddings=40960,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def chats(n: int, seed: int = 0) -> list[dict]:
    """`n` prompt/response pairs with a learnable answer: "what is A plus B?" -> the sum in words."""
    out = []
    for i in range(n):
        a, b = (i * 7 + seed) % 5, (i * 3 + 2 * seed) % 5
        out.append({"prompt": f"what is {WORDS[a]} plus {WORDS[b]}?", "response": f"{WORDS[a + b]}."})
    return out


def write_chats(path, n: int, seed: int = 0) -> Path:
    """chats(n, seed) as a JSON lines file (data.kind: sft's format)."""
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in chats(n, seed)))
    return path


def make_chat_tokenizer(folder, vocab_size: int = 300):
    """A fast byte-level BPE tokenizer (about `vocab_size` ids) with the ChatML template, saved into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                          "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [f"{r['prompt']} {r['response']} user assistant system" for r in chats(50)]
    tok.train_from_iterator(text * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(folder))
    return fast


def make_qwen3_checkpoint(folder, shapes: dict = SMALL_QWEN3, dtype: torch.dtype = torch.float32,
                          device: str = "cpu", seed: int = 0, tokenizer: bool = True) -> dict:
    """A Qwen3MoeForCausalLM of `shapes` with random weights (std hidden_size ** -0.5; norms 1), saved with
    save_pretrained (safetensors) into `folder`, plus make_chat_tokenizer's tokenizer there (unless
    `tokenizer` is false). Returns the folder, the bytes written and the seconds spent building and saving."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    config = transformers.Qwen3MoeConfig(**shapes)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(config).to(dtype)
    std = shapes["hidden_size"] ** -0.5  # 0.022 at Qwen3-30B-A3B's width; a small model's head can still learn
    with torch.no_grad():  # transformers' init leaves some tensors at zero; make every one random
        for name, t in model.named_parameters():
            t.fill_(1.0) if "norm" in name else t.normal_(0.0, std)
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
    built = time.perf_counter() - t0
    model.save_pretrained(str(folder))
    del model
    if tokenizer:
        make_chat_tokenizer(folder)
    saved = time.perf_counter() - t0 - built
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {"folder": folder, "bytes": size, "build_s": built, "save_s": saved}
