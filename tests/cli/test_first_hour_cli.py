"""Issue 42.18: what a new user reads in the first hour says what it means. A CPU run's throughput is per rank
(not per GPU) and the summary says it is a mean, `moelab status` that its tok/s is the last step's; the summary
is named by the run folder (`--out runs/long` is not `tiny:`); presets show tiny in M, not "0.00B"; `set` and
`status` describe their arguments; `set` on a finished run points to `moelab fork`."""
from __future__ import annotations

import re

from moelab.cli import build_parser
from support import SMALL_CLI, moelab_cli


def test_a_cpu_run_reports_per_rank_named_by_its_folder_and_set_after_it_points_to_fork(tmp_path):
    out = tmp_path / "long"
    r = moelab_cli("run", "tiny", *SMALL_CLI, "--steps", 2, "--set", "train.checkpoint_every=1", "--out", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("long: COMPLETED at step 2/2"), r.stdout
    assert "tokens/s, mean over steps" in r.stdout and "per rank" in r.stdout and "TFLOPs per rank" in r.stdout
    assert "GPU" not in r.stdout
    status = moelab_cli("status", out)
    assert "tok/s (last step)" in status.stdout, status.stdout
    r = moelab_cli("set", out, "aux_loss_coeff=0.02")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"`moelab fork {out} --step 2 --set aux_loss_coeff=0.02`" in r.stderr, r.stderr


def test_presets_show_small_models_in_their_unit():
    r = moelab_cli("presets")
    tiny = next(line for line in r.stdout.splitlines() if line.startswith("tiny "))
    assert "0.00B" not in r.stdout and re.search(r"\d+\.\d\d[MK] total", tiny), tiny
    assert "671.03B total" in r.stdout  # deepseek-v3 stays in billions


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")
    return sub.choices[command].format_help()


def test_set_and_status_describe_their_arguments():
    text = _help("set")
    assert "the folder of a running" in text and "a field and its new value" in text and "moelab fork" in text
    text = _help("status")
    assert "a run folder, a sweep folder, or a folder with runs under it" in text and "last step" in text
