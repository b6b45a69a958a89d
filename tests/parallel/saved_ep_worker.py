"""Rank side of test_recompute_exchanges.py's held-bytes test: one MoE block's bytes held from forward to backward,
per token, measured as the C heap's growth over the forward (glibc's mallinfo2; CPU tensors live there, Python's
small objects do not), minus the block's output.

    python saved_ep_worker.py OUT.json      (one process: a one-rank gloo group carries the EP dispatcher)

Cases: sequence length x (local dispatch, the EP all-to-all) x (no recompute, selective), bf16 with the grouped
GEMM as on a GPU and the fake balanced gate (every expert gets T*K/E rows).
"""
import ctypes
import gc
import json
import sys

import torch
import torch.distributed as dist

import moelab.model.experts as experts_module
from moelab.config import load_config
from moelab.model.layers import rope_cos_sin
from moelab.model.transformer import Block
from moelab.parallel.expert_parallel import AllToAllDispatcher

SHAPES = ["model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=64",
          "model.moe.expert_ffn_size=128", "model.moe.num_experts=16", "model.moe.top_k=4",
          "train.dtype=bfloat16", "train.param_dtype=bfloat16", "backend.fake_balanced_gate=true"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def heap_bytes(libc) -> int:
    info = libc.mallinfo2()
    return info.hblkhd + info.uordblks  # mmapped blocks and in-use heap


def held_per_token(cfg, L: int, recompute: str, ep: bool, libc) -> float:
    m = cfg.model
    torch.manual_seed(0)
    block = Block(m, cfg.backend, m.num_layers - 1).to(torch.bfloat16)
    if ep:
        block.ffn.dispatcher = AllToAllDispatcher(dist.group.WORLD)
    block.recompute = recompute
    x = torch.randn(1, L, m.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(L), m.head_dim, m.rope_theta, torch.bfloat16)
    block(x, cos, sin)  # once before measuring: lazily made caches and buffers
    gc.collect()
    before = heap_bytes(libc)
    out = block(x, cos, sin)
    gc.collect()
    return (heap_bytes(libc) - before - out.untyped_storage().nbytes()) / L


def main(path: str) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    experts_module.grouped_mm_supported = lambda x, *dims: True  # the GPU's grouped GEMM (torch runs it on CPU)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}.store", rank=0, world_size=1)
    out = {"shapes": SHAPES}
    for L in (512, 1024):
        for ep in (False, True):
            for recompute in ("none", "selective"):
                cfg = load_config("tiny", SHAPES + [f"parallel.ep={2 if ep else 1}", f"train.seq_len={L}"])
                out[f"{L}-{'ep' if ep else 'local'}-{recompute}"] = held_per_token(cfg, L, recompute, ep, libc)
    with open(path, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
