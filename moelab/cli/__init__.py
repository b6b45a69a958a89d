"""The `moelab` command: a thin shell over the Python API, every subcommand under one name.

    moelab run tiny --steps 50 --out runs/tiny        # through Session.submit, like a notebook
    moelab run tiny --nproc 2 --set parallel.ep=2
    moelab resume runs/tiny                           # continue from the last checkpoint
    moelab status runs/ ; moelab cancel runs/tiny
    moelab presets ; moelab plan CONFIG --gpus 8 ; moelab bench CONFIG ; moelab report FOLDER
    moelab compare SWEEP_FOLDER --out fig.png ; moelab gallery list | run NAME | report

The job verbs are in moelab.cli.jobs, the tools in moelab.cli.tools.
"""
from __future__ import annotations

import argparse
import sys

from moelab.cli import jobs, tools
from moelab.config import ConfigError
from moelab.run.folder import FolderLocked


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moelab", description="Mixture-of-Experts training lab")
    sub = ap.add_subparsers(dest="command", required=True)
    jobs.add_parsers(sub)
    tools.add_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"moelab: config error: {e}", file=sys.stderr)
        return 2
    except FolderLocked as e:
        print(f"moelab: refused: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
