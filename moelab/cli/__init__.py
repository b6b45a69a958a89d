"""The `moelab` command: a thin shell over the Python API, every subcommand under one name.

    moelab run tiny --steps 50 --out runs/tiny        # through Session.submit, like a notebook
    moelab run tiny --nproc 2 --set parallel.ep=2
    moelab resume runs/tiny                           # continue from the last checkpoint
    moelab status runs/ ; moelab cancel runs/tiny
    moelab unlock runs/tiny                           # break a lock whose owner this host cannot check
    moelab presets ; moelab plan CONFIG --gpus 8 ; moelab bench CONFIG ; moelab report FOLDER
    moelab compare SWEEP_FOLDER --out fig.png ; moelab gallery list | run NAME | report

The job verbs are in moelab.cli.jobs, the tools in moelab.cli.tools.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from moelab.cli import jobs, tools
from moelab.config import ConfigError
from moelab.contract.folder import FolderLocked
from moelab.contract.writes import FolderWriteError


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moelab", description="Mixture-of-Experts training lab")
    ap.add_argument("--debug", action="store_true",
                    help="show the full traceback of an error (also MOELAB_DEBUG=1); default: one line")
    sub = ap.add_subparsers(dest="command", required=True)
    jobs.add_parsers(sub)
    tools.add_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("MOELAB_DEBUG", "") not in ("", "0")
    previous = warnings.showwarning
    if not debug and previous is not _one_line_warning:  # a second main() in one process must not wrap itself
        _one_line_warning.default = previous
        warnings.showwarning = _one_line_warning
    try:
        return args.func(args)
    except BrokenPipeError:  # `moelab status runs/ | head -1`: the reader has what it wanted
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:  # Ctrl-C before a run's step loop (it checkpoints and stops once the loop runs)
        if debug:
            raise
        print("moelab: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the errors a user meets get one line; --debug shows the traceback
        line = one_line_error(e)
        if debug or line is None:
            raise
        print(f"moelab: {line}", file=sys.stderr)
        return 2 if isinstance(e, (ConfigError, FolderLocked, FileNotFoundError)) or line.startswith("refused") else 1
    finally:
        warnings.showwarning = previous


def _quiet_stdout() -> None:
    """stdout to /dev/null: the interpreter's final flush into the closed pipe would print a second
    BrokenPipeError (Python's documented recipe, the signal module's "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def one_line_error(e: BaseException) -> str | None:
    """The one line a known error is shown as (None: an unexpected error, shown with its traceback)."""
    from submitit.core.utils import FailedJobError

    from moelab.launch.jobs import NotCancellable
    from moelab.launch.local import RankFailed
    from moelab.contract.checkpoints import CheckpointError

    if isinstance(e, ConfigError):
        return f"config error: {e}"
    if isinstance(e, (FolderLocked, NotCancellable)):
        return f"refused: {e}"
    if isinstance(e, (FileNotFoundError, FolderWriteError)):  # a folder write names the cause, the path, the fix
        return str(e)
    if isinstance(e, RankFailed):
        lines = [x for x in str(e).splitlines() if x.strip()]
        return f"{lines[0]}: {lines[-1].strip()}" if len(lines) > 1 else lines[0]
    if isinstance(e, FailedJobError):
        lines = [x for x in str(e).splitlines() if x.strip()]
        return "job submission failed: " + " ".join(x.strip() for x in lines[-2:])[:400]
    if isinstance(e, CheckpointError):
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A MetricsWarning (a damaged metrics line, ...) as one line; other warnings as Python shows them."""
    from moelab.contract.stream import MetricsWarning

    if not issubclass(category, MetricsWarning):
        return _one_line_warning.default(message, category, filename, lineno, file, line)
    print(f"moelab: warning: {str(message).splitlines()[0] if str(message) else category.__name__}",
          file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
