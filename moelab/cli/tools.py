"""The tool verbs of the `moelab` command: presets, plan, bench, report, compare, gallery.

    moelab presets
    moelab plan qwen3-moe-30b-a3b --gpus 8
    moelab plan deepseek-v3 --gpus 256 --gpu h100     # + predicted tokens/s/GPU and the step's parts
    moelab export runs/tiny --to tensorboard     # the metrics stream as TensorBoard event files
    moelab export runs/tiny --to hf out/tiny-hf  # the newest checkpoint in transformers' layout
    moelab bench qwen3-moe-30b-a3b-proxy --steps 10 --json result.json
    moelab report runs/tiny-20261130-101500          # throughput, memory and routing PNGs
    moelab compare runs/my-sweep --out routing.png   # a sweep folder, or run folders
    moelab gallery list | run NAME | report
"""
from __future__ import annotations

import argparse
import json
import os

from moelab.planner.gpus import GPU_KINDS


def config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a preset name (see `moelab presets`) or a YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.moe.num_experts=16 (repeatable)")


def load_args(args):
    """The Config that `config` and `--set` (and `--steps`, where the command has it) name."""
    from moelab.config import load_config
    from moelab.run.session import SOURCE_READERS

    overrides = list(args.overrides)
    if getattr(args, "steps", None) is not None:
        overrides.append(f"train.steps={args.steps}")
    return load_config(args.config, overrides, readers=SOURCE_READERS)


def cmd_presets(args) -> int:
    from moelab.config import load_config
    from moelab.planner.flops import count_params
    from moelab.presets import preset_names

    for name in preset_names():
        cfg = load_config(name)
        pc = count_params(cfg.model)
        moe = cfg.model.moe
        print(f"{name:28s} {_count(pc.total):>8s} total {_count(pc.activated):>8s} active  "
              f"{cfg.model.num_layers:3d} layers  {moe.num_experts:4d} experts top-{moe.top_k}")
    return 0


def _count(n: float) -> str:
    """A parameter count in the unit that shows it: 671.03B, 3.21M, 912.38K (tiny is not 0.00B)."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def cmd_plan(args) -> int:
    from moelab.planner.plan import plan

    p = plan(load_args(args), gpus=args.gpus, gpu_memory_gb=args.gpu_memory_gb, gpu=args.gpu)
    print(json.dumps(p.to_dict(), indent=1) if args.json else p)
    return 0


def cmd_report(args) -> int:
    from moelab.live.plots import write_report

    for path in write_report(args.folder, args.out):
        print(path)
    return 0


def cmd_compare(args) -> int:
    from moelab.live.compare import main

    return main(args.argv)
EXPORT_KINDS = ("tensorboard", "wandb", "hf")


def cmd_export(args) -> int:
    from moelab.config import ConfigError

    to, *dest = args.to  # `--to hf OUT`: the output folder may follow the kind (argparse takes no positional there)
    if to not in EXPORT_KINDS or len(dest) > 1:
        raise ConfigError(f"export --to {' '.join(args.to)}: give --to KIND [OUT], KIND one of "
                          f"{', '.join(EXPORT_KINDS)}")
    given = [x for x in (*dest, args.dest, args.out) if x]
    if len(set(given)) > 1:
        raise ConfigError(f"export: output folders {given}: give the output folder once")
    out = given[0] if given else None
    if to == "hf":
        from moelab.export.hf import export_hf

        if not out:
            raise ConfigError("export --to hf: OUT is required (moelab export RUN --to hf OUT)")
        print(export_hf(args.folder, out, dtype=args.dtype, max_shard_size=args.max_shard_size, lora=args.lora,
                        force=args.force, base=args.base))
        return 0
    from moelab.loggers.mirror import export_run

    print(export_run(args.folder, to=to, out=out, wandb_mode=args.wandb_mode))
    return 0


def cmd_bench(args) -> int:
    from moelab.train.bench import bench, format_result, write_result
    from moelab.config import load_config

    cfg = load_config(args.config, args.overrides)
    r = bench(cfg, steps=args.steps, warmup=args.warmup, peak_tflops=args.peak_tflops,
              real_router=not args.no_real_router, metrics_overhead=not args.no_metrics_overhead)
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_result(r))
        if args.json:
            write_result(r, args.json)
            print(f"result: {args.json}")
    return 0


def cmd_gallery(args) -> int:
    from moelab.gallery import main as gallery_main

    return gallery_main(args)


def add_parsers(sub) -> None:
    p = sub.add_parser("presets", help="list the named configs")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("plan", help="parameters, FLOPs, memory per GPU, communication and a fits verdict")
    config_args(p)
    p.add_argument("--gpus", type=int, help="world size (default: the product of the config's layout)")
    p.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU (default: this CUDA device, else 80, an H100)")
    p.add_argument("--gpu", choices=sorted(GPU_KINDS), help="predict the step time and tokens/s/GPU on this GPU "
                   "kind (moelab.planner.speed; its memory unless --gpu-memory-gb)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("report", help="write a run's throughput, memory and routing plots as PNG files")
    p.add_argument("folder", help="a run folder (holds metrics.jsonl)")
    p.add_argument("--out", help="output folder (default FOLDER/report)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("compare", help="compare runs: a table and loss / balance / routing figures",
                       add_help=False)
    p.add_argument("argv", nargs=argparse.REMAINDER, help="a sweep folder or run folders; --out FIG.png; --last N")
    p.set_defaults(func=cmd_compare)
    _add_export_parser(sub)

    p = sub.add_parser("bench", help="time training steps: tokens/s/GPU, TFLOPs/GPU, MFU, peak memory")
    config_args(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--json", help="write the result record to this JSON file")
    p.add_argument("--peak-tflops", type=float, help="peak for MFU (default: the GPU's datasheet bf16 peak)")
    p.add_argument("--no-real-router", action="store_true",
                   help="with backend.fake_balanced_gate=true, time only the fake gate (then the headline; the "
                        "default times the learned router as the headline and the fake gate beside it)")
    p.add_argument("--no-metrics-overhead", action="store_true", help="skip timing steps without metrics")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("gallery", help="benchmark gallery: list | run NAME | report")
    from moelab.gallery import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_gallery)


def _add_export_parser(sub) -> None:
    """`moelab export`: a run's metrics to TensorBoard or W&B, or its newest checkpoint in HF's layout."""
    p = sub.add_parser("export", help="write a run's metrics stream as TensorBoard event files (or to W&B), or "
                                      "its newest checkpoint in transformers' layout (--to hf OUT)")
    p.add_argument("folder", help="a run folder (holds metrics.jsonl)")
    p.add_argument("dest", nargs="?", help="output folder (the same as --out; required for --to hf)")
    p.add_argument("--to", nargs="+", default=["tensorboard"], metavar=("KIND", "OUT"),
                   help=f"{' | '.join(EXPORT_KINDS)} (default tensorboard), optionally followed by OUT")
    p.add_argument("--out", help="output folder (default FOLDER/tensorboard; for wandb, FOLDER)")
    p.add_argument("--wandb-mode", choices=["offline", "online"], default="offline")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="hf: weight dtype (default: the checkpoint's)")
    p.add_argument("--max-shard-size", default="5GB", help="hf: shard past this size, with an index (default 5GB)")
    p.add_argument("--lora", choices=["merged", "adapters"],
                   help="hf: LoRA adapters folded into the weights, or alone in PEFT's layout (default: merged)")
    p.add_argument("--base", help="hf: the HF checkpoint folder the run started from (default: from its config)")
    p.add_argument("--force", action="store_true", help="hf: write into an output folder that is not empty")
    p.set_defaults(func=cmd_export)
