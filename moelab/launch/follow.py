"""The job verbs of the `moelab` command: submit and follow, status, cancel (a thin shell over Session/Run).

    moelab run tiny --executor local --nproc 2 --set parallel.ep=2     # follows the job until it ends
    moelab run tiny --executor slurm --cluster gpus_per_node=8 --cluster time=60 --cluster partition=gpu
    moelab status runs/tiny-20261130-101500       # one run, or every run under a folder
    moelab cancel runs/tiny-20261130-101500
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from moelab.config import parse_override
from moelab.run import RUN_FILE, SWEEP_FILE, TERMINAL, Run, Sweep, runs


def submit_and_follow(cfg, executor: str, nproc: int, out: "str | None", cluster: list[str]) -> int:
    """Submit `cfg` and print a progress line until the run ends; exit code 0 only if it COMPLETED.
    Ctrl-C cancels the job."""
    from moelab.session import Session

    options = dict(parse_override(item) for item in cluster)
    run = Session(cfg).submit(executor, nproc=nproc, folder=out, **options)
    print(f"submitted {run.name}: executor {run.executor}, job {run.job_id or '-'}, folder {run.folder}")
    try:
        follow(run)
    except KeyboardInterrupt:
        print("\ninterrupted: cancelling the job", file=sys.stderr)
        run.cancel()
        run.wait(60)
    return _report(run)


def follow(run: Run, poll_s: float = 1.0, stream=None) -> Run:
    """Print one progress line per change until the run ends (rewritten in place on a terminal)."""
    stream = stream or sys.stdout
    tty = stream.isatty()
    last = None
    while True:
        line = progress_line(run)
        if line != last:
            stream.write(("\r\033[K" + line) if tty else line + "\n")
            stream.flush()
            last = line
        if run.status in TERMINAL:
            break
        time.sleep(poll_s)
    if tty:
        stream.write("\n")
    return run


def progress_line(run: Run) -> str:
    p = run.progress()
    parts = [f"[{p['status']}]", f"step {p['step']}/{p['total_steps'] or '?'}"]
    if p["loss"] is not None:
        parts.append(f"loss {p['loss']:.4f}")
    if p["tokens_per_s"]:
        parts.append(f"{p['tokens_per_s']:,.0f} tok/s")
    return "  ".join(parts)


def _report(run: Run) -> int:
    status = run.status
    if status == "COMPLETED" and run.summary:
        from moelab.train.summary import format_summary

        print(format_summary(run.summary))
    elif run.error:
        print(run.error.rstrip(), file=sys.stderr)
    print(f"{run.name}: {status}  (run folder: {run.folder})")
    return 0 if status == "COMPLETED" else 1


def cmd_status(args) -> int:
    """One line per run: the folder itself, a sweep, or every run under a folder."""
    selected = _select(Path(args.folder))
    for run in selected:
        print(f"{str(run.folder):50s} {progress_line(run)}  {run.executor} {run.job_id or ''}".rstrip())
        if run.status in ("FAILED", "TIMEOUT") and run.error and len(selected) == 1:
            print(run.error.rstrip())
    return 0


def cmd_cancel(args) -> int:
    selected = [r for r in _select(Path(args.folder)) if r.status not in TERMINAL]
    if not selected:
        print(f"nothing to cancel under {args.folder}: no run there is pending or running")
        return 0
    for run in selected:
        run.cancel()
    for run in selected:
        run.wait(args.wait)
        print(f"{run.name}: {run.status}")
    return 0 if all(r.status == "CANCELLED" for r in selected) else 1


def _select(folder: Path) -> list[Run]:
    if (folder / RUN_FILE).exists() or (folder / "metrics.jsonl").exists():
        return [Run.load(folder)]
    if (folder / SWEEP_FILE).exists():
        return list(Sweep.load(folder))
    found = runs(folder)
    if not found:
        raise FileNotFoundError(f"no moelab run under {folder}")
    return found


def add_job_arguments(p) -> None:
    """`moelab run` options that send the run to an executor instead of this process."""
    p.add_argument("--executor", choices=["inline", "local", "slurm", "auto"],
                   help="run through an executor and follow it: local (background processes), slurm (sbatch), "
                        "auto (slurm where sbatch exists); default: this process")
    p.add_argument("--cluster", action="append", default=[], metavar="KEY=VALUE",
                   help="cluster option for --executor, e.g. --cluster time=60 --cluster gpus_per_node=8 "
                        "(see moelab.launch.executors; repeatable)")


def add_parsers(sub) -> None:
    p = sub.add_parser("status", help="status of a run folder, a sweep, or every run under a folder")
    p.add_argument("folder")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("cancel", help="cancel the pending or running job(s) of a run folder or sweep")
    p.add_argument("folder")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the scheduler to confirm")
    p.set_defaults(func=cmd_cancel)

