"""The gallery's fine-tuning entry (gallery/entries/qwen3-moe-30b-a3b-proxy-finetune-1gpu.yaml) on one GPU:
make the Qwen3-30B-A3B proxy checkpoint with transformers, then fine-tune it with moelab from `hf:` it.

    python gallery/scripts/finetune_gpu.py make  --ckpt /tmp/qwen3-proxy-hf [--tiny]
    python gallery/scripts/finetune_gpu.py train --ckpt /tmp/qwen3-proxy-hf --mode lora|full --out DIR
                                                 [--steps 20] [--compile] [--tiny]

make: a Qwen3MoeForCausalLM of the proxy's shapes (8 layers of Qwen3-30B-A3B, random weights) built on the GPU in
bf16 and written with save_pretrained (safetensors), plus a small chat tokenizer (moelab.hf.example_checkpoint);
timed; DIR/make.json. train: an SFT run (data.kind sft on short chats, packed, seq 4096, micro batch 2, bf16
parameters) from `hf:CKPT`, LoRA (rank 16 on attention + routed experts) or full fine-tuning; the weight loading
timed (bytes, seconds), tokens/s and peak memory from the run's summary, the planner's memory estimate beside
them; DIR/<entry>--moelab--<mode>[-compile].json in gallery/results' format (moelab.gallery.RESULT_FIELDS plus
the rest). --tiny: the same code on CPU with make_qwen3_checkpoint's small shapes (the test runs it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

ENTRY = "qwen3-moe-30b-a3b-proxy-finetune-1gpu"
LORA = ["train.lora.rank=16", "train.lora.alpha=32", "train.lora.targets=attention,experts"]
GPU_SET = ["train.seq_len=4096", "train.micro_batch_size=2", "train.global_batch_size=2", "train.dtype=bfloat16",
           "train.param_dtype=bfloat16", "train.device=cuda"]
TINY_SET = ["train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=2", "train.device=cpu"]


def make(args) -> dict:
    from moelab.hf.example_checkpoint import QWEN3_30B_A3B_PROXY, SMALL_QWEN3, make_qwen3_checkpoint

    if args.tiny:
        made = make_qwen3_checkpoint(args.ckpt, SMALL_QWEN3)
    else:
        made = make_qwen3_checkpoint(args.ckpt, QWEN3_30B_A3B_PROXY, dtype=torch.bfloat16, device="cuda")
    rec = {"what": "the proxy checkpoint, made with transformers", "folder": str(made["folder"]),
           "bytes": made["bytes"], "build_s": round(made["build_s"], 2), "save_s": round(made["save_s"], 2),
           "transformers_version": __import__("transformers").__version__}
    print(f"checkpoint: {made['bytes'] / 1e9:.2f} GB, built in {made['build_s']:.1f} s, saved in "
          f"{made['save_s']:.1f} s")
    return rec


def overrides(args) -> list[str]:
    from moelab.hf.example_checkpoint import write_chats

    data = write_chats(Path(args.out) / "chats.jsonl", 400 if args.tiny else 4000)
    sets = [*(TINY_SET if args.tiny else GPU_SET), "data.kind=sft", f"data.path={data}",
            f"train.steps={args.steps}", "train.warmup_steps=2",
            f"train.lr={1e-3 if args.mode == 'lora' else 1e-5}", "train.save_checkpoints=false",
            f"train.compile={str(args.compile).lower()}"]
    return sets + (LORA if args.mode == "lora" else []) + list(args.set)


def train(args) -> dict:
    import moelab.hf.sharded_load as sharded_load
    from moelab.train.bench import commit_id
    from moelab.hf.source import load_config
    from moelab.planner.flops import FLOPS_CONVENTION
    from moelab.planner.plan import plan
    from moelab.train.trainer import Trainer

    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("finetune_gpu.py train: no CUDA device (use --tiny on CPU)")
    sets = overrides(args)
    cfg = load_config(f"hf:{args.ckpt}", sets)
    planned = plan(cfg, gpus=1)
    timed = {}
    load_into = sharded_load.load_into

    def timed_load(*a, **k):  # the trainer's own loading, timed
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = load_into(*a, **k)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            timed["load_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        timed["load_s"] = time.perf_counter() - t0
        return out

    sharded_load.load_into = timed_load
    run_dir = Path(args.out) / f"run-{args.mode}{args.tag}"
    t0 = time.perf_counter()
    try:
        tr = Trainer(cfg, run_dir, progress=True)  # DistEnv.from_environ(train.device): the GPU
        s = tr.run()
    finally:
        sharded_load.load_into = load_into
    wall = time.perf_counter() - t0
    trained = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
    variant = args.mode + ("-compile" if args.compile else "") + args.tag
    # the entry is the LoRA run; full fine-tuning's record is beside it under a workload of its own
    workload = ENTRY if args.mode == "lora" else ENTRY.replace("-finetune-", "-full-finetune-")
    rec = {"system": "moelab", "workload": workload, "variant": variant, "gpus": 1, "gpu_name": tr.gpu_name,
           "device": tr.env.device,
           "tokens_per_s_per_gpu": s.get("tokens_per_s_per_gpu"), "tflops_per_gpu": s.get("tflops_per_gpu"),
           "peak_memory_gb": s.get("peak_memory_gb"), "flops_convention": FLOPS_CONVENTION,
           "command": " ".join(["python"] + sys.argv),
           "commit": os.environ.get("MOELAB_COMMIT") or commit_id(), "torch_version": torch.__version__,
           "date": datetime.date.today().isoformat(),
           "mode": args.mode, "compile": args.compile, "steps": s.get("steps"), "status": s.get("status"),
           "first_loss": s.get("first_loss"), "final_loss": s.get("final_loss"),
           "step_time_s": s.get("step_time_s"), "trained_params": trained,
           "total_params": planned.total_params,
           "load_bytes": tr.loaded["bytes_read"] if tr.loaded else None,
           "load_s": round(timed.get("load_s", float("nan")), 2),
           "load_peak_memory_gb": timed.get("load_peak_gb"),
           "planned_memory_gb": planned.memory_per_gpu_bytes / 1e9,
           "planned_loading": planned.loading,
           "planned_trained_params": planned.trained_params,
           "flops_note": None if args.mode != "lora" else
           "tflops_per_gpu keeps the convention's 6 x activated params; LoRA skips the frozen weights' "
           "weight-gradient matmuls, so it does about 4 x of work per parameter",
           "run_wall_s": round(wall, 1), "overrides": sets,
           "tokens_note": "tokens/s counts global batch x seq_len positions per step (packed rows, padding in)"}
    print(f"{variant}: {rec['status']}, loss {rec['first_loss']:.3f} -> {rec['final_loss']:.3f}, "
          f"{rec['tokens_per_s_per_gpu'] or 0:,.0f} tokens/s, peak {rec['peak_memory_gb'] or 0:.1f} GB "
          f"(plan {rec['planned_memory_gb']:.1f} GB), loaded {rec['load_bytes'] or 0:,} bytes in "
          f"{rec['load_s']} s, {trained:,} trained parameters")
    return rec


def main(argv=None) -> int:
    if os.environ.get("STACKS_S"):  # where a slow part spends its time, in its log (finetune_gpu.sh)
        import faulthandler

        faulthandler.dump_traceback_later(int(os.environ["STACKS_S"]), repeat=True)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["make", "train"])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/finetune_out"))
    p.add_argument("--mode", choices=["lora", "full"], default="lora")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another config override")
    p.add_argument("--tag", default="", help="appended to the variant and the run folder, e.g. -nopack")
    p.add_argument("--tiny", action="store_true", help="CPU, small shapes: checks the script")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.what == "make":
        rec, name = make(args), "make.json"
    else:
        rec = train(args)
        name = f"{rec['workload']}--moelab--{rec['variant']}.json"
    (Path(args.out) / name).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
