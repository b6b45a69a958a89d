"""Compare runs side by side: one table row per run, loss and balance over steps, routing heatmaps.

    sweep = Session("tiny").sweep({"model.moe.aux_loss_coeff": [0.0, 0.01]}, executor="local")
    cmp = sweep.wait().compare()            # or compare([run_a, run_b]), compare(["runs/a", "runs/b"])
    cmp.table                               # a pandas DataFrame (a list of dicts without pandas)
    cmp.plot_losses(); cmp.plot_balance(); cmp.plot_heatmaps()    # matplotlib Figures
    cmp                                     # in Jupyter: the table and the three figures

From a shell (what the gallery's routing figure is made with):

    moelab compare runs/my-sweep --out routing.png       # a sweep folder, or run folders

Balance is measured on the router's demand, the tokens routed to each expert BEFORE capacity dropping
(``routing.routed_per_expert`` of the step events; older streams fall back to ``tokens_per_expert``), so a
capacity factor cannot hide an imbalance; what it dropped is its own column. Per step and MoE layer:
max/mean = the busiest expert's load over the mean load, cv = std/mean of the load (population std); both are
averaged over layers (moelab.contract.summary.step_balance, the one definition the dashboard and summary.json use
too), then over steps. "final" = the mean over the last ``final_window`` steps (default: the last 10%).

Shape legend (docs/shapes.md): I steps, M MoE layers, E experts.
"""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from moelab.config import flatten
from moelab.live.plots import new_figure, style_axes, thin_points, to_png
from moelab.contract.folder import RunFolder, read_json
from moelab.run.controls import live_config
from moelab.run.run import Run
from moelab.contract.stream import scan_events
from moelab.contract.summary import demand_ME, step_balance

COLUMNS = ("run", "status", "steps", "final_loss", "eval_loss", "max_over_mean", "final_max_over_mean", "cv",
           "final_cv", "dropped_pct", "dead_experts")


def compare(sweep_or_runs, final_window: int | None = None, labels: list[str] | None = None) -> "Comparison":
    """A Comparison of a Sweep, a sweep folder, or a list of Runs / run folders. `labels` name the runs in
    the plots (default: their swept values, else their names)."""
    return Comparison(sweep_or_runs, final_window, labels)


class Comparison:
    """Runs compared (see the module docstring). ``.table`` has one row per run: the swept values, then
    final_loss, eval_loss (the last held-out loss, None without train.eval_every), max_over_mean /
    final_max_over_mean, cv / final_cv, dropped_pct (dropped assignments, % of all)
    and dead_experts (dead at the last step: no tokens for model.moe.dead_expert_steps steps).

        cmp = compare(["runs/a", "runs/b"]); cmp.table; cmp.plot_balance()
    """

    def __init__(self, sweep_or_runs, final_window: int | None = None, labels: list[str] | None = None):
        self.runs, points = _open(sweep_or_runs)
        if not self.runs:
            raise ValueError("compare: no runs given; pass a Sweep, a sweep folder, or a list of Runs/run folders")
        self.swept = _swept_values(self.runs, points)  # one {dotted key: value} per run
        self.labels = list(labels) if labels else [
            ", ".join(f"{k.rsplit('.', 1)[-1]}={_fmt(v)}" for k, v in sw.items()) or r.name
            for r, sw in zip(self.runs, self.swept)]
        if len(self.labels) != len(self.runs):
            raise ValueError(f"compare: {len(self.labels)} labels for {len(self.runs)} runs")
        self.final_window = final_window
        self._data = [_RunData(r) for r in self.runs]
        self.rows = [self._row(i) for i in range(len(self.runs))]

    # ------------------------------------------------------------------ the table
    def _row(self, i: int) -> dict:
        run, d = self.runs[i], self._data[i]
        row = {"run": run.name, **self.swept[i]}
        n = len(d.steps)
        w = self.final_window or max(1, round(0.1 * n))
        summary = run.summary or {}
        row.update(
            status=run.status, steps=d.steps[-1] if n else 0,
            final_loss=summary.get("final_loss", d.loss[-1] if n else None),
            eval_loss=d.eval_loss[-1] if d.eval_loss else None,  # the last held-out loss (train.eval_every)
            max_over_mean=_mean(d.max_over_mean_I), final_max_over_mean=_mean(d.max_over_mean_I[-w:]),
            cv=_mean(d.cv_I), final_cv=_mean(d.cv_I[-w:]),
            dropped_pct=100.0 * d.dropped / d.assignments if d.assignments else 0.0,
            dead_experts=d.dead_at_end)
        return row

    @property
    def table(self):
        """One row per run (a pandas DataFrame where pandas is installed, else a list of dicts)."""
        try:
            import pandas as pd
        except ImportError:
            return [dict(r) for r in self.rows]
        return pd.DataFrame(self.rows).set_index("run")

    # ------------------------------------------------------------------ plots
    def plot_losses(self) -> Figure:
        """Training loss over steps, one line per run (and its held-out loss, dashed, where it has one)."""
        fig = new_figure(6.4, 3.4)
        self._draw_losses(fig.add_subplot())
        return fig

    def plot_balance(self) -> Figure:
        """max/mean load and cv of the load over steps (mean over MoE layers), one line per run."""
        fig = new_figure(10.0, 3.4)
        ax1, ax2 = fig.subplots(1, 2)
        self._draw_balance(ax1, ax2)
        return fig

    def plot_heatmaps(self, last: int | None = None) -> Figure:
        """Routing heatmaps side by side: MoE layer x expert, each expert's tokens over the layer's mean load
        (1 = even share, 0 = no tokens), summed over the whole run or its `last` steps; one colour scale."""
        fig = new_figure(max(3.0 * len(self.runs), 6.0), 0.3 * self._num_layers() + 2.2)
        self._draw_heatmaps(fig, fig.subplots(1, len(self.runs), squeeze=False)[0], last)
        return fig

    def figure(self, last: int | None = None) -> Figure:
        """All of it in one Figure (the gallery's routing comparison): loss, max/mean and cv over steps on
        top, the routing heatmaps below."""
        n = len(self.runs)
        fig = new_figure(max(13.0, 3.0 * n), 4.0 + 0.3 * self._num_layers() + 2.0, dpi=100)
        top, bottom = fig.subfigures(2, 1, height_ratios=[1.3, 1.0])
        a, b, c = top.subplots(1, 3)
        self._draw_losses(a)
        self._draw_balance(b, c)
        self._draw_heatmaps(bottom, bottom.subplots(1, n, squeeze=False)[0], last)
        return fig

    def _num_layers(self) -> int:
        return max((d.load_IME.shape[1] for d in self._data), default=1)

    def _draw_losses(self, ax) -> None:
        for label, d in zip(self.labels, self._data):
            line, = ax.plot(*thin_points(d.steps, d.loss), label=label, lw=1.2)
            if d.eval_steps:  # held-out loss: dashed, in the run's colour
                ax.plot(d.eval_steps, d.eval_loss, ls="--", marker="o", ms=3, lw=1, color=line.get_color(),
                        label=f"{label} (eval)")
        style_axes(ax, "training loss", "step", "loss")
        ax.legend(fontsize=7)

    def _draw_balance(self, ax_max, ax_cv) -> None:
        for label, d in zip(self.labels, self._data):
            ax_max.plot(*thin_points(d.steps, d.max_over_mean_I), label=label, lw=1.2)
            ax_cv.plot(*thin_points(d.steps, d.cv_I), label=label, lw=1.2)
        ax_max.axhline(1.0, color="0.3", ls="--", lw=1)
        style_axes(ax_max, "busiest expert / mean load (mean over layers)", "step", "max / mean")
        style_axes(ax_cv, "coefficient of variation of the load", "step", "cv")
        ax_cv.legend(fontsize=7)

    def _draw_heatmaps(self, fig, axes, last: int | None) -> None:
        loads = []
        for d in self._data:
            counts_ME = d.load_IME[-last:].sum(0) if last else d.load_IME.sum(0)
            mean_M1 = counts_ME.mean(-1, keepdims=True)
            loads.append(np.divide(counts_ME, mean_M1, out=np.zeros_like(counts_ME), where=mean_M1 > 0))
        top = max([2.0] + [float(x.max()) for x in loads if x.size])
        norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)
        im = None
        for ax, label, load_ME in zip(axes, self.labels, loads):
            if not load_ME.size:
                ax.text(0.5, 0.5, "no routing", ha="center", va="center", transform=ax.transAxes)
                continue
            im = ax.imshow(load_ME, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
            style_axes(ax, label, "expert", "MoE layer")
            ax.grid(False)
            M, E = load_ME.shape
            ax.set_yticks(range(0, M, max(M // 8, 1)))
            ax.set_xticks(range(0, E, max(E // 8, 1)))
        if im is not None:
            span = f"last {last} steps" if last else "whole run"
            cb = fig.colorbar(im, ax=list(axes), fraction=0.03, pad=0.01)
            cb.set_label(f"tokens / mean ({span})", fontsize=8)
            cb.ax.tick_params(labelsize=7)

    # ------------------------------------------------------------------ display
    def __repr__(self) -> str:
        table = self.table
        text = table.to_string(float_format=lambda x: f"{x:.4g}") if hasattr(table, "to_string") else \
            "\n".join(json.dumps(r) for r in table)
        return f"Comparison of {len(self.runs)} runs\n{text}"

    def _repr_html_(self) -> str:
        table = self.table
        if hasattr(table, "to_html"):
            table_html = table.to_html(float_format=lambda x: f"{x:.4g}", classes="moelab-comparison")
        else:
            head = "".join(f"<th>{html.escape(str(k))}</th>" for k in table[0])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in r.values()) + "</tr>"
                           for r in table)
            table_html = f"<table class='moelab-comparison'><tr>{head}</tr>{body}</table>"
        imgs = "".join(f"<img src='data:image/png;base64,{base64.b64encode(to_png(f)).decode()}'/>"
                       for f in (self.plot_losses(), self.plot_balance(), self.plot_heatmaps()))
        return f"<div><b>Comparison of {len(self.runs)} runs</b>{table_html}{imgs}</div>"


class _RunData:
    """What the comparison reads from one run's step events, as arrays over steps."""

    def __init__(self, run):
        metrics = RunFolder(run.folder).metrics
        steps = scan_events(metrics, kinds=("step",))
        self.steps = [e.step for e in steps]
        self.loss = [e.loss for e in steps]
        evals = scan_events(metrics, kinds=("eval",))
        self.eval_steps, self.eval_loss = [e.step for e in evals], [e.loss for e in evals]
        demand = [demand_ME(e) for e in steps]
        self.load_IME = np.asarray(demand, dtype=np.float64) if steps and all(demand) else run.routing()
        if self.load_IME.ndim != 3:
            self.load_IME = np.zeros((len(steps), 0, 0))
        per_step = [step_balance(c) for c in self.load_IME] if self.load_IME.size else [None] * len(steps)
        self.max_over_mean_I = [b["max_over_mean"] if b else None for b in per_step]
        self.cv_I = [b["cv"] if b else None for b in per_step]
        self.dropped = sum(sum(e.routing.dropped_tokens_M or []) for e in steps if e.routing is not None)
        self.assignments = float(self.load_IME.sum())
        self.dead_at_end = len(steps[-1].health.dead_experts) if steps and steps[-1].health is not None else 0


# ---------------------------------------------------------------------- opening runs
def _open(source) -> tuple[list, list | None]:
    """(runs, sweep points or None) from a Sweep, a sweep folder, a run folder, or a list of Runs/folders."""
    if isinstance(source, (str, Path)):
        info = read_json(RunFolder(source).sweep_path)
        source = [Path(source) / r for r in info["runs"]] if info else [source]
        folder = Path(source[0]).parent if info else None
    else:
        folder = getattr(source, "folder", None)  # a Sweep's folder
        info = read_json(RunFolder(folder).sweep_path) if folder is not None else None
    runs = [Run.load(r) if isinstance(r, (str, Path)) else r for r in source]
    points = info["points"] if info and len(info.get("points", [])) == len(runs) else None
    return runs, points


def _swept_values(runs: list, points: list | None) -> list[dict]:
    """The sweep's points, or else the config values that differ between the runs (name aside)."""
    if points is not None:
        return [dict(p) for p in points]
    # the config as trained: config.yaml with the changes applied while it trained (a fork's changes included)
    flat = [flatten(live_config(r.folder).to_dict()) for r in runs]
    keys = [k for k in flat[0] if k != "name" and len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
    return [{k: f.get(k) for k in keys} for f in flat]




def _mean(xs: list) -> float | None:
    vals = [x for x in xs if x is not None and x == x]
    return float(np.mean(vals)) if vals else None


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="moelab compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="a sweep folder, or run folders")
    ap.add_argument("--out", help="write the comparison figure to this PNG")
    ap.add_argument("--last", type=int, default=None, help="heatmaps over the last N steps (default: all)")
    args = ap.parse_args(argv)
    source = args.folders[0] if len(args.folders) == 1 else args.folders
    cmp = compare(source)
    print(repr(cmp))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        cmp.figure(args.last).savefig(args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
