"""Submit -> first step event of the tiny preset, on this machine: the local executor cold (MOELAB_WARM=0), the
local executor with its warm rank process (moelab.launch.warm), and the local SLURM cluster, each N times, with the
machine's load beside each figure; the rank log's warm-start line says whether a rank was forked.

    python gallery/scripts/first_metric.py --out gallery/results/first-metric-cpu.json [--repeat 3] [--no-slurm]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from moelab import Session
from moelab.launch import warm

FORKED = "moelab.launch.warm: this rank was forked"


def first_step_s(run, t0: float, timeout: float = 300.0) -> float:
    metrics = Path(run.folder) / "metrics.jsonl"
    while time.time() - t0 < timeout:
        if metrics.exists() and '"event": "step"' in metrics.read_text():
            return time.time() - t0
        time.sleep(0.01)
    raise TimeoutError(f"no step event in {metrics} after {timeout} s")


def one(executor: str, root: Path, i: int, **options) -> dict:
    s = Session("tiny", train={"steps": 3, "device": "cpu"})
    load = os.getloadavg()[0]
    t0 = time.time()
    run = s.submit(executor, folder=root / f"{executor}-{i}-{os.getenv('MOELAB_WARM', '1')}", **options)
    t = first_step_s(run, t0)
    run.wait()
    return {"executor": executor, "warm": FORKED in run.logs(rank=0), "first_step_s": round(t, 3),
            "load_1min": round(load, 2), "status": str(run.status)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-slurm", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="first-metric-") as tmp:
        root = Path(tmp)
        os.environ["MOELAB_WARM"] = "0"
        rows += [one("local", root, i) for i in range(args.repeat)]
        os.environ["MOELAB_WARM"] = "1"
        warm.start()
        time.sleep(20)  # the server's imports, as a notebook's Session() gives it before the first submit
        rows += [one("local", root, i) for i in range(args.repeat)]
        if not args.no_slurm and shutil.which("sbatch"):
            rows += [one("slurm", root, i, time=10) for i in range(args.repeat)]
    for r in rows:
        print(f"{r['executor']:6s} warm={r['warm']!s:5s} first step after {r['first_step_s']:6.2f} s "
              f"(load {r['load_1min']:.2f}) {r['status']}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    Path(args.out).write_text(json.dumps({
        "what": "submit -> first step event, tiny preset, 3 steps", "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "commit": commit,
        "command": "python gallery/scripts/first_metric.py --out " + args.out,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
