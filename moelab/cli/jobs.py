"""The job verbs of the `moelab` command: run, resume, status, cancel (a thin shell over Session and Run).

    moelab run tiny --steps 50                                          # in this process (inline)
    moelab run tiny --nproc 2 --set parallel.ep=2                       # 2 local processes, followed until the end
    moelab run tiny --executor local --nproc 2 --set parallel.ep=2      # the same, said explicitly
    moelab resume runs/tiny-20261130-101500                             # continue from the last checkpoint
    moelab run tiny --executor slurm --cluster gpus_per_node=8 --cluster time=60 --cluster partition=gpu
    moelab status runs/tiny-20261130-101500       # one run, or every run under a folder
    moelab cancel runs/tiny-20261130-101500
    moelab unlock runs/tiny-20261130-101500       # break the writer lock of an owner this host cannot check
    moelab set runs/tiny-20261130-101500 model.moe.aux_loss_coeff=0.01 --wait 60   # a change while it trains
    moelab fork runs/tiny-20261130-101500 --step 20 --name aux --set aux_loss_coeff=0.01   # a new run from step 20
"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from moelab.cli.tools import config_args, load_args
from moelab.config import parse_override
from moelab.contract.folder import RunFolder
from moelab.launch.executors import EXECUTORS
from moelab.run.run import TERMINAL, Run
from moelab.run.sweep import Sweep, runs


def cmd_run(args) -> int:
    """Through Session.submit, like a notebook: the same run.json, folder rules and executors. Without
    --executor: in this process for one rank, on the local executor for --nproc N."""
    from moelab.run.session import Session

    executor = args.executor or ("inline" if args.nproc == 1 else "local")
    options = dict(parse_override(item) for item in args.cluster)
    run = Session(load_args(args)).submit(executor, nproc=args.nproc, folder=args.out, **options)
    return finish(run)


def cmd_resume(args) -> int:
    from moelab.launch.resume import resume
    from moelab.contract.checkpoints import CheckpointError
    from moelab.contract.stream import MetricsError

    options = dict(parse_override(item) for item in args.cluster)
    try:
        job = resume(args.folder, steps=args.steps, nproc=args.nproc, **options)
    except (CheckpointError, MetricsError) as e:
        print(f"moelab: cannot resume: {e}", file=sys.stderr)
        return 2
    return finish(Run(args.folder, job.info, job), failed_code=3)


def finish(run: Run, failed_code: int = 1) -> int:
    """Follow a submitted run until it ends (Ctrl-C cancels the job), then report it; an inline run has
    finished already. Exit code 0 only if it COMPLETED."""
    if run.in_background:
        print(f"submitted {run.name}: executor {run.executor}, job {run.job_id or '-'}, folder {run.folder}")
        previous = signal.signal(signal.SIGTERM, _terminated)
        try:
            follow(run)
        except KeyboardInterrupt:
            print("\ninterrupted: cancelling the job", file=sys.stderr)
            run.cancel()
            run.wait(60)
        except Terminated:
            preempt = getattr(run.job, "preempt", None)
            if preempt is None:  # a SLURM job is not this process' child: it goes on
                print(f"\nSIGTERM: no longer following; the job goes on (moelab status {run.folder})",
                      file=sys.stderr)
                return 1
            print("\nSIGTERM: passed on to the ranks (checkpoint at the step boundary, then PREEMPTED)",
                  file=sys.stderr)
            preempt()
            run.wait(120)
        finally:
            signal.signal(signal.SIGTERM, previous)
    return _report(run, failed_code)


class Terminated(Exception):
    """SIGTERM reached `moelab run` while it follows a job (raised by the handler _terminated).

        signal.signal(signal.SIGTERM, _terminated)   # then: except Terminated: forward the stop, report
    """


def _terminated(signum, frame):
    raise Terminated()


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
        parts.append(f"{p['tokens_per_s']:,.0f} tok/s (last step)")
    if p.get("pending_reason"):
        parts.append(f"waiting: {p['pending_reason']}")
    return "  ".join(parts)


def _report(run: Run, failed_code: int = 1) -> int:
    status = run.status
    if status == "CANCELLED" and not run.in_background:  # only Ctrl-C in this process cancels a foreground run
        print(f"moelab: interrupted at step {run.progress()['step']}: run CANCELLED at the step boundary (with a "
              f"checkpoint unless train.save_checkpoints=false); continue with `moelab resume {run.folder}`",
              file=sys.stderr)
        return 130
    if status == "COMPLETED" and run.summary:
        from moelab.contract.stream import tail_events
        from moelab.contract.summary import format_summary

        last, first = tail_events(run.run_folder.metrics, kinds=("start",))
        starts = last or first
        device = starts[-1].env.device if starts and starts[-1].env else None
        print(format_summary(run.summary, name=run.name, device=device))
    elif run.error:
        print(run.error.rstrip(), file=sys.stderr)
    print(f"{run.name}: {status}  (run folder: {run.folder})")
    if status == "PREEMPTED":
        print(f"moelab: stopped by a signal at step {run.progress()['step']}; continue with "
              f"`moelab resume {run.folder}`", file=sys.stderr)
    return 0 if status == "COMPLETED" else failed_code


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


def cmd_unlock(args) -> int:
    """Remove a run folder's writer lock whose owner is gone or cannot be checked from here (another host, no
    SLURM job to ask); refused (FolderLocked) while the owner is known to run."""
    from moelab.contract.folder import break_lock

    owner = break_lock(args.folder)
    if not owner:
        print(f"{args.folder}: no owner named in its lock; nothing to unlock")
        return 0
    job = f", job {owner['job_id']}" if owner.get("job_id") else ""
    print(f"{args.folder}: lock of pid {owner.get('pid')} on {owner.get('host')}{job} ({owner.get('role', '?')}) "
          f"removed; the next writer takes it")
    return 0


def cmd_set(args) -> int:
    """Ask a running run to change fields at its next step boundary (moelab.run.controls)."""
    from moelab.run.controls import request, wait_outcome

    run = Run.load(args.folder)
    changes = dict(parse_override(item) for item in args.changes)
    if run.status == "COMPLETED":  # no step is left to change: a fork from a checkpoint takes the change
        from moelab.config import ConfigError
        from moelab.config.live import check_changes
        from moelab.run.controls import live_config, resolve
        from moelab.run.fork import checkpoint_steps

        cfg = live_config(run.folder)
        check_changes(cfg, resolve(changes, cfg))  # a field no run can change is refused as that first
        steps = checkpoint_steps(run.folder)
        at = f"--step {steps[-1]} " if steps else ""
        raise ConfigError(f"run {run.name} is COMPLETED: there is no step left to change; start a new run from one "
                          f"of its checkpoints ({steps or 'none'}) with the change: `moelab fork {run.folder} {at}"
                          + " ".join(f"--set {c}" for c in args.changes) + "`")
    rid = request(run, changes, origin="cli", at=args.at)
    if args.wait is None:
        when = "the next step boundary" if args.at is None else f"the boundary after step {args.at}"
        print(f"{run.name}: requested {', '.join(args.changes)} (request {rid}); applied at {when}")
        return 0
    outcome = wait_outcome(run.folder, rid, timeout=args.wait, run=run)
    if outcome is None:
        status = run.status
        when = ("it applies at the run's next step boundary" if not run.done else
                f"it applies when the run is resumed (`moelab resume {run.folder}`)")
        print(f"{run.name}: requested {', '.join(args.changes)} (request {rid}); not applied within {args.wait:g} s "
              f"(the run is {status}); {when}")
        return 1
    if outcome["kind"] == "rejected":
        print(f"{run.name}: refused at step {outcome['step']}: {outcome['reason']}", file=sys.stderr)
        return 2
    print(f"{run.name}: applied after step {outcome['step']}: " + ", ".join(
        f"{k} {old!r} -> {new!r}" for k, (old, new) in outcome["changes"].items()))
    return 0


def cmd_fork(args) -> int:
    """A new run from a run's checkpoint, with changes (moelab.run.fork); followed like `moelab run`."""
    changes = dict(parse_override(item) for item in args.changes)
    options = dict(parse_override(item) for item in args.cluster)
    child = Run.load(args.folder).fork(step=args.step, name=args.name, folder=args.out, executor=args.executor,
                                       nproc=args.nproc, cluster=options, **changes)
    print(f"fork {child.folder} of {args.folder} at step {child.parent['step']}")
    return finish(child)


def _select(folder: Path) -> list[Run]:
    if RunFolder(folder).holds_run():
        return [Run.load(folder)]
    if RunFolder(folder).is_sweep():
        return list(Sweep.load(folder))
    found = runs(folder)
    if not found:
        raise FileNotFoundError(f"no moelab run under {folder}")
    return found


def add_parsers(sub) -> None:
    p = sub.add_parser("run", help="train a config: in this process, on N local processes, or on SLURM")
    config_args(p)
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    p.add_argument("--out", help="run folder (default runs/<config name>-<time>); must not hold a run yet")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this machine (default 1)")
    p.add_argument("--executor", choices=[*EXECUTORS, "auto"],
                   help="inline (this process), local (background processes), slurm (sbatch), auto (slurm where "
                        "sbatch exists); default: inline for one rank, local for --nproc N")
    _cluster_argument(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("resume", help="continue a run folder from its last checkpoint")
    p.add_argument("folder", help="the run folder (holds config.yaml and checkpoints/)")
    p.add_argument("--steps", type=int, help="train until this step instead of the config's train.steps")
    p.add_argument("--nproc", type=int, help="local processes (default: as many as the run had)")
    _cluster_argument(p)
    p.set_defaults(func=cmd_resume)

    _add_control_parsers(sub)
    p = sub.add_parser("fork", help="start a new run from a run's checkpoint, with changes")
    p.add_argument("folder")
    p.add_argument("--set", dest="changes", action="append", default=[], metavar="KEY=VALUE",
                   help="a change from the fork step on (repeatable); without any, the parent's steps again")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    p.add_argument("--name", help="the fork's name (its folder: PARENT-fork<step>-<name> beside the parent)")
    p.add_argument("--out", help="the fork's folder")
    p.add_argument("--executor", choices=list(EXECUTORS), help="default: the parent's")
    p.add_argument("--nproc", type=int, help="ranks (default: as many as the parent had)")
    _cluster_argument(p)
    p.set_defaults(func=cmd_fork)


def _add_control_parsers(sub) -> None:
    """The commands that look at or steer existing runs: status, cancel, unlock, set."""
    p = sub.add_parser("status", help="status of a run folder, a sweep, or every run under a folder",
                       description="One line per run: [STATUS] step N/M, the last step's loss and tok/s (the last "
                                   "step's throughput; the summary at the end gives the mean), executor and job id; "
                                   "for one FAILED run, its error (a rank killed by a signal is named).")
    p.add_argument("folder", help="a run folder, a sweep folder, or a folder with runs under it (e.g. runs/)")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("cancel", help="cancel the pending or running job(s) of a run folder or sweep")
    p.add_argument("folder")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the scheduler to confirm")
    p.set_defaults(func=cmd_cancel)
    p = sub.add_parser("unlock", help="break a run folder's writer lock held by an owner this host cannot check "
                                      "(another host); refused while the owner is known to run")
    p.add_argument("folder")
    p.set_defaults(func=cmd_unlock)
    p = sub.add_parser("set", help="change fields of a running run at its next step boundary (lr, aux/z-loss, "
                                   "bias update, capacity, freeze_router, expert lr, intervals, checkpoint=true)",
                       description="Ask a running run to change fields from its next step boundary on (recorded in "
                                   "controls.jsonl and as control events). A finished run has no step left: fork it "
                                   "from a checkpoint with the change (`moelab fork RUN --step K --set KEY=VALUE`).")
    p.add_argument("folder", help="the folder of a running (or pending) run")
    p.add_argument("changes", nargs="+", metavar="KEY=VALUE",
                   help="a field and its new value, dotted or by its last part: train.lr=1e-4, aux_loss_coeff=0.01, "
                        "checkpoint=true (save one at the next boundary)")
    p.add_argument("--wait", type=float, help="seconds to wait until the ranks applied it (default: do not wait)")
    p.add_argument("--at", type=int, help="apply it at the boundary after this step (the next one where the run is "
                                          "past it; default: the next boundary)")
    p.set_defaults(func=cmd_set)


def _cluster_argument(p) -> None:
    p.add_argument("--cluster", action="append", default=[], metavar="KEY=VALUE",
                   help="cluster option, e.g. --cluster time=60 --cluster gpus_per_node=8 "
                        "(see moelab.launch.executors; repeatable)")
