"""The gallery's routing comparison: five load-balancing strategies on the tiny preset with a skewed router,
trained for real on this machine's CPU, compared with moelab.live.compare.

    python gallery/scripts/routing_comparison.py                 # -> gallery/routing/routing_comparison.png
    python gallery/scripts/routing_comparison.py --steps 200 --runs /tmp/routing-runs

Writes the figure and routing_comparison.md (the table, and this command) next to it. The runs go to --runs
(default: a folder under /tmp), one after another in this process (the inline executor).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from moelab.live.compare import compare
from moelab.run.session import Session

GALLERY = Path(__file__).resolve().parents[1]
# name -> overrides on top of the shared base (no balancing at all, a skewed selection bias)
STRATEGIES = {
    "none": {},
    "aux loss 0.01": {"model.moe.aux_loss_coeff": 0.01},
    "seq aux loss 0.01": {"model.moe.aux_loss_coeff": 0.01, "model.moe.aux_loss_type": "sequence"},
    "aux-free bias 0.002": {"model.moe.bias_update_rate": 0.002},
    "capacity 1.0 dynamic": {"model.moe.capacity_factor": 1.0, "model.moe.dynamic_capacity": True},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--skew", type=float, default=0.02, help="model.moe.init_bias_skew")
    ap.add_argument("--runs", default=None, help="folder for the run folders (default: a new temp folder)")
    ap.add_argument("--out", default=str(GALLERY / "routing" / "routing_comparison.png"))
    args = ap.parse_args(argv)
    root = Path(args.runs or tempfile.mkdtemp(prefix="moelab-routing-"))
    base = Session("tiny", train={"steps": args.steps},
                   model={"moe": {"aux_loss_coeff": 0.0, "init_bias_skew": args.skew}})
    runs = []
    for name, overrides in STRATEGIES.items():
        folder = root / name.replace(" ", "-")
        t0 = time.time()
        runs.append(base.set({**overrides, "name": name}).submit("inline", folder=folder))
        print(f"{name}: {runs[-1].status} in {time.time() - t0:.0f} s ({folder})", flush=True)
    cmp = compare(runs, labels=list(STRATEGIES))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmp.figure(last=max(args.steps // 5, 1)).savefig(out)
    command = "python gallery/scripts/routing_comparison.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out.with_suffix(".md")).write_text(
        f"# Routing comparison\n\n![routing comparison]({out.name})\n\n"
        f"Made by `{command.strip()}` ({time.strftime('%Y-%m-%d')}, CPU, tiny preset, {args.steps} steps, "
        f"`model.moe.init_bias_skew={args.skew}`). Balance is measured on the router's demand (before capacity "
        f"dropping); heatmaps cover the last {max(args.steps // 5, 1)} steps. torch {torch.__version__}.\n\n"
        + "```\n" + repr(cmp) + "\n```\n")
    print(repr(cmp))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
