"""The `moelab` command: a thin shell over the Python API.

    moelab run tiny --steps 50 --out runs/tiny
    moelab run tiny --nproc 2 --set parallel.ep=2
    moelab resume runs/tiny            # continue from the last checkpoint
    moelab run tiny --executor local   # or slurm: submit through submitit and follow the job
    moelab status runs/tiny-...        # moelab cancel runs/tiny-...
    moelab presets
    moelab export runs/tiny --to tensorboard     # the metrics stream as TensorBoard event files
    moelab bench qwen3-moe-30b-a3b-proxy --steps 10 --json result.json
"""
from __future__ import annotations

import argparse
import sys

from moelab.config import ConfigError


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a preset name (see `moelab presets`) or a YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.moe.num_experts=16 (repeatable)")


def _load(args):
    from moelab.config import load_config

    overrides = list(args.overrides)
    if getattr(args, "steps", None) is not None:
        overrides.append(f"train.steps={args.steps}")
    return load_config(args.config, overrides)


def cmd_run(args) -> int:
    from pathlib import Path

    from moelab.train.summary import format_summary

    cfg = _load(args)
    if args.executor:
        from moelab.launch.follow import submit_and_follow

        return submit_and_follow(cfg, args.executor, args.nproc, args.out, args.cluster)
    out = Path(args.out or f"runs/{cfg.name}")
    if args.nproc > 1:
        from moelab.launch.local import run_local_processes

        summary = run_local_processes(cfg, out, args.nproc)
    else:
        from moelab.train.trainer import Trainer

        summary = Trainer(cfg, out, progress=True).run()
    print(format_summary(summary))
    print(f"run folder: {out}")
    return 0


def cmd_resume(args) -> int:
    from moelab.launch.resume import resume
    from moelab.train.checkpoint import CheckpointError
    from moelab.train.metrics import MetricsError
    from moelab.train.summary import format_summary

    try:
        summary = resume(args.folder, steps=args.steps, nproc=args.nproc, progress=True)
    except (CheckpointError, MetricsError) as e:
        print(f"moelab: cannot resume: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    print(f"run folder: {args.folder}")
    return 0 if summary["status"] == "COMPLETED" else 3


def cmd_presets(args) -> int:
    from moelab.config import load_config
    from moelab.flops import count_params
    from moelab.presets import preset_names

    for name in preset_names():
        cfg = load_config(name)
        pc = count_params(cfg.model)
        moe = cfg.model.moe
        print(f"{name:28s} {pc.total / 1e9:8.2f}B total {pc.activated / 1e9:7.2f}B active  "
              f"{cfg.model.num_layers:3d} layers  {moe.num_experts:4d} experts top-{moe.top_k}")
    return 0


def cmd_plan(args) -> int:
    import json

    from moelab.plan import plan

    p = plan(_load(args), gpus=args.gpus, gpu_memory_gb=args.gpu_memory_gb)
    print(json.dumps(p.to_dict(), indent=1) if args.json else p)
    return 0


def cmd_report(args) -> int:
    from moelab.live.plots import write_report

    for path in write_report(args.folder, args.out):
        print(path)
    return 0


def cmd_export(args) -> int:
    from moelab.train.export import export_run

    print(export_run(args.folder, to=args.to, out=args.out, wandb_mode=args.wandb_mode))
    return 0


def cmd_bench(args) -> int:
    from moelab.bench import bench, format_result, write_result
    from moelab.config import load_config

    cfg = load_config(args.config, args.overrides)
    r = bench(cfg, steps=args.steps, warmup=args.warmup, peak_tflops=args.peak_tflops,
              real_router=not args.no_real_router, metrics_overhead=not args.no_metrics_overhead)
    if int(__import__("os").environ.get("RANK", "0")) == 0:
        print(format_result(r))
        if args.json:
            write_result(r, args.json)
            print(f"result: {args.json}")
    return 0


def cmd_gallery(args) -> int:
    from moelab.gallery import main as gallery_main

    return gallery_main(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moelab", description="Mixture-of-Experts training lab")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="train a config in-process (or on N local processes)")
    _config_args(p)
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    p.add_argument("--out", help="run folder (default runs/<config name>)")
    p.add_argument("--nproc", type=int, default=1, help="local processes (torchrun-style ranks)")
    from moelab.launch.follow import add_job_arguments, add_parsers

    add_job_arguments(p)
    p.set_defaults(func=cmd_run)
    add_parsers(sub)  # status, cancel

    p = sub.add_parser("resume", help="continue a run folder from its last checkpoint")
    p.add_argument("folder", help="the run folder (holds config.yaml and checkpoints/)")
    p.add_argument("--steps", type=int, help="train until this step instead of the config's train.steps")
    p.add_argument("--nproc", type=int, help="local processes (default: as many as the run had)")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("presets", help="list the named configs")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("plan", help="parameters, FLOPs, memory per GPU, communication and a fits verdict")
    _config_args(p)
    p.add_argument("--gpus", type=int, help="world size (default: the product of the config's layout)")
    p.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU (default: this CUDA device, else 80, an H100)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("report", help="write a run's throughput, memory and routing plots as PNG files")
    p.add_argument("folder", help="a run folder (holds metrics.jsonl)")
    p.add_argument("--out", help="output folder (default FOLDER/report)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("export", help="write a run's metrics stream as TensorBoard event files (or to W&B)")
    p.add_argument("folder", help="a run folder (holds metrics.jsonl)")
    p.add_argument("--to", choices=["tensorboard", "wandb"], default="tensorboard")
    p.add_argument("--out", help="output folder (default FOLDER/tensorboard; for wandb, FOLDER)")
    p.add_argument("--wandb-mode", choices=["offline", "online"], default="offline")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("bench", help="time training steps: tokens/s/GPU, TFLOPs/GPU, MFU, peak memory")
    _config_args(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--json", help="write the result record to this JSON file")
    p.add_argument("--peak-tflops", type=float, help="peak for MFU (default: the GPU's datasheet bf16 peak)")
    p.add_argument("--no-real-router", action="store_true",
                   help="with backend.fake_balanced_gate=true, skip timing the learned router beside it")
    p.add_argument("--no-metrics-overhead", action="store_true", help="skip timing steps without metrics")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("gallery", help="benchmark gallery: list | run NAME | report")
    from moelab.gallery import add_arguments as _gallery_arguments

    _gallery_arguments(p)
    p.set_defaults(func=cmd_gallery)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"moelab: config error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
