"""What one MoE block really keeps for backward on a GPU, against the planner, without and with selective
recompute, on one process (local dispatch) and through the expert-parallel all-to-all dispatcher (a one-rank
NCCL group: the EP code path, every row received by this rank, W = T*K as on EP ranks under balanced routing).

    python gallery/scripts/gpu_check_saved_ep.py OUT.json [SEQ ...]      (one GPU)

Held bytes = torch.cuda.memory_allocated after the block's forward minus before, minus its output; per token;
the planner's: moelab.planner.saved.saved_per_token (none) and moelab.planner.recompute.selective_kept_per_token
(selective), at the Qwen3-30B-A3B proxy's block shapes in bf16 with the fake balanced gate (balanced rows).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from moelab.config import load_config
from moelab.model.layers import rope_cos_sin
from moelab.model.transformer import Block
from moelab.parallel.expert_parallel import AllToAllDispatcher
from moelab.planner.recompute import selective_kept_per_token
from moelab.planner.saved import saved_per_token


def held(cfg, L: int, recompute: str, ep: bool) -> float:
    m = cfg.model
    torch.manual_seed(0)
    block = Block(m, cfg.backend, m.num_layers - 1).to("cuda", torch.bfloat16)
    if ep:
        block.ffn.dispatcher = AllToAllDispatcher(dist.group.WORLD)
    block.recompute = recompute
    x = torch.randn(1, L, m.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(L, device="cuda"), m.head_dim, m.rope_theta, torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = block(x, cos, sin)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    out.float().square().mean().backward()
    return kept / L


def main(path: str, seqs: list[int]) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    rows = []
    for L in seqs:
        for ep in (False, True):
            for recompute in ("none", "selective"):
                cfg = load_config("qwen3-moe-30b-a3b-proxy", ["train.dtype=bfloat16", "train.param_dtype=bfloat16",
                                                              "backend.fake_balanced_gate=true", f"train.seq_len={L}",
                                                              f"parallel.ep={2 if ep else 1}"])
                planned = (sum(v for k, v in saved_per_token(cfg, True, 2).items() if k != "input")
                           if recompute == "none" else selective_kept_per_token(cfg, True, 2, True))
                got = held(cfg, L, recompute, ep)
                rows.append({"seq": L, "ep": ep, "recompute": recompute, "held_per_token": got,
                             "planned_per_token": planned, "ratio": got / planned})
                print(rows[-1], flush=True)
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], [int(s) for s in sys.argv[2:]] or [2048, 4096])
