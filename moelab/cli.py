"""The `moelab` command: a thin shell over the Python API.

    moelab run tiny --steps 50 --out runs/tiny
    moelab run tiny --nproc 2 --set parallel.ep=2
    moelab presets
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
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("presets", help="list the named configs")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("plan", help="parameters, FLOPs, memory per GPU, communication and a fits verdict")
    _config_args(p)
    p.add_argument("--gpus", type=int, help="world size (default: the product of the config's layout)")
    p.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU (default: this CUDA device, else 80, an H100)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)

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
