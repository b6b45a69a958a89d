"""Issue 41: the optimizer step overlapped with the next forward (moelab.train.overlap) on the GPU's streams.

A deterministic model whose optimizer pass is long against its forward (a 151,936-token vocabulary, small blocks,
torch's grouped GEMM, eager attention, deterministic algorithms) trains --steps steps four times from the same
seed: without the overlap, with it, without it again, and with it but the forward's waits taken off (the negative
control: the forward then reads weights the side stream is still writing). The first three must agree bitwise
(losses and every weight). The control is reported, not required: in call 25 it agreed too (the update's blocks ran before the
forward's kernels at equal stream priorities), so this model did not show a missing wait.

    python gallery/scripts/gpu_check_overlap.py --out DIR      # DIR/overlap-check.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from moelab.config import load_config
from moelab.train.bench import commit_id
from moelab.train.trainer import Trainer

SET = ["model.vocab_size=151936", "model.hidden_size=1024", "model.num_layers=4", "model.num_heads=8",
       "model.num_kv_heads=4", "model.head_dim=128", "model.moe.num_experts=16", "model.moe.top_k=4",
       "model.moe.expert_ffn_size=512", "train.seq_len=512", "train.micro_batch_size=2", "train.global_batch_size=4",
       "train.dtype=bfloat16", "train.param_dtype=bfloat16", "train.compile=false", "train.device=cuda",
       "backend.experts=grouped_mm", "backend.attention=eager", "backend.loss=chunked",
       "train.save_checkpoints=false", "train.lr=1e-3", "train.warmup_steps=0", "data.kind=random"]


def run(steps: int, overlap: str, waits: bool = True) -> tuple[list[float], list[torch.Tensor], bool]:
    torch.manual_seed(0)
    cfg = load_config("tiny", SET + [f"train.optimizer_overlap={overlap}"])
    tr = Trainer(cfg, tempfile.mkdtemp(prefix="moelab-overlap-"))
    tr.setup()
    used = tr.overlap is not None
    if used and not waits:
        for h in tr.overlap.handles:
            h.remove()
    losses = [tr.train_step(s + 1)["loss"] for s in range(steps)]
    tr.join_optimizer()
    torch.cuda.synchronize()
    return losses, [p.detach().clone() for p in tr.model.parameters()], used


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)
    runs = {"off": run(args.steps, "off"), "auto": run(args.steps, "auto"), "off again": run(args.steps, "off"),
            "auto without the forward's waits": run(args.steps, "auto", waits=False)}
    base_l, base_p, _ = runs["off"]
    rec = {"system": "moelab", "workload": "overlap-check", "variant": "overlap-check",
           "device": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "config": SET, "steps": args.steps, "runs": {}}
    for name, (losses, params, used) in runs.items():
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(params, base_p))
        same = losses == base_l and diff == 0.0
        rec["runs"][name] = {"overlap_used": used, "losses": losses, "bitwise_equal_to_off": same,
                             "max_abs_weight_diff_vs_off": diff}
        print(f"overlap {name:34s} used {used!s:5s} bitwise equal to off: {same!s:5s} max |dw| {diff:.3e} "
              f"losses {[round(x, 5) for x in losses[:4]]}", flush=True)
    ok = (rec["runs"]["off again"]["bitwise_equal_to_off"] and rec["runs"]["auto"]["bitwise_equal_to_off"]
          and rec["runs"]["auto"]["overlap_used"])
    rec["ok"] = ok
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "overlap-check.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(f"overlap check {'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
