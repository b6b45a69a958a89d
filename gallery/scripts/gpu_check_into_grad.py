"""Issue 41: the token embedding and the LM head at the Qwen3-30B-A3B proxy's shapes (vocabulary 151,936, hidden 2,048,
bf16 weights, micro batch 2 x 4,096 tokens), their backward over --micro-batches micro batches two ways: autograd's
(each micro batch's gradient written in full, then `.grad +=`) and moelab.backends.into_grad's (a later micro batch
added into .grad by the head's GEMM and row by row for the embedding). Checked against an fp32 sum of the same
terms, timed (median of --reps CUDA-event runs of the whole accumulation, forward and the hidden states' gradient
included, as in the model).

    python gallery/scripts/gpu_check_into_grad.py --out DIR      # DIR/into-grad.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

import moelab.backends.into_grad as G
from moelab.train.bench import StepTimer, commit_id

V, D, T = 151936, 2048, 8192


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--micro-batches", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    emb, head = nn.Embedding(V, D).to(dev, bf), nn.Linear(D, V, bias=False).to(dev, bf)
    ids = [torch.randint(0, V, (2, T // 2), device=dev) for _ in range(args.micro_batches)]
    hs = [torch.randn(2, T // 2, D, device=dev, dtype=bf, requires_grad=True) for _ in range(args.micro_batches)]
    gs = [torch.randn(2, T // 2, V, device=dev, dtype=bf) * 1e-3 for _ in range(args.micro_batches)]
    gh = [torch.randn(2, T // 2, D, device=dev, dtype=bf) for _ in range(args.micro_batches)]

    def run(use_into_grad: bool):
        emb.weight.grad = head.weight.grad = None
        for i in range(args.micro_batches):
            if use_into_grad:
                e, y = G.embedding(emb, ids[i]), G.linear(head, hs[i])
            else:
                e, y = emb(ids[i]), head(hs[i])
            torch.autograd.backward([e, y], [gh[i], gs[i]])
        return emb.weight.grad.clone(), head.weight.grad.clone()
    exact_e = torch.zeros(V, D, device=dev)
    exact_h = torch.zeros(V, D, device=dev)
    for i in range(args.micro_batches):
        exact_e.index_add_(0, ids[i].reshape(-1), gh[i].reshape(-1, D).float())
        exact_h.addmm_(gs[i].reshape(-1, V).float().t(), hs[i].detach().reshape(-1, D).float())
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    timer = StepTimer(dev)
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "into-grad-check",
           "device": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "micro_batches": args.micro_batches,
           "shapes": {"vocab": V, "hidden": D, "tokens": T}, "results": {}}
    for label, flag in (("autograd (.grad +=)", False), ("moelab.backends.into_grad", True)):
        de, dh = run(flag)
        ms = statistics.median(timer.time(lambda _: run(flag), args.reps))
        rec["results"][label] = {"ms": ms, "ms_per_micro_batch": ms / args.micro_batches,
                                 "embedding_rel_err_vs_fp32": rel(de, exact_e),
                                 "head_rel_err_vs_fp32": rel(dh, exact_h)}
        print(f"into-grad {label:28s} {ms:8.3f} ms ({ms / args.micro_batches:.3f} per micro batch), rel err "
              f"embedding {rec['results'][label]['embedding_rel_err_vs_fp32']:.2e} head "
              f"{rec['results'][label]['head_rel_err_vs_fp32']:.2e}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "into-grad.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
