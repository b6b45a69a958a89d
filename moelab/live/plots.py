"""Static plots of a run, as matplotlib Figures (Agg canvas, no pyplot: safe from any thread, no global state).

The same panel functions draw the live dashboard's charts and the report figures, from a `DashState`.

    fig = plot_routing("runs/tiny")              # a Run, a run folder or a DashState
    fig.savefig("routing.png")
    write_report("runs/tiny")                    # what `moelab report runs/tiny` does

Shape legend: L = MoE layers, E = experts per layer, R = ranks.
"""
from __future__ import annotations

import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

import numpy as np

from moelab.config.paths import check_path
from moelab.live.state import ROUTING_WINDOW, DashState, load_state

MAX_POINTS = 2000  # line charts thin long histories to this many points


class ReportFigure(Figure):
    """A matplotlib Figure that also shows itself in Jupyter when no pyplot backend registered a formatter."""

    def _repr_png_(self) -> bytes:
        return to_png(self)


def new_figure(width: float, height: float, dpi: int = 80) -> Figure:
    fig = ReportFigure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def to_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def thin_points(xs: list, ys: list) -> tuple[list, list]:
    """Every k-th point (and the last), skipping missing values (a skipped step has no loss)."""
    k = max(len(xs) // MAX_POINTS, 1)
    idx = list(range(0, len(xs), k))
    if xs and idx[-1] != len(xs) - 1:
        idx.append(len(xs) - 1)
    pts = [(xs[i], ys[i]) for i in idx if ys[i] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _empty(ax, text: str = "waiting for the first step") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5")
    ax.set_xticks([])
    ax.set_yticks([])


def style_axes(ax, title: str, xlabel: str = "", ylabel: str = "") -> None:
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


# ---------------------------------------------------------------------- panels (one Axes each)
def draw_series(ax, st: DashState, values: list, title: str, ylabel: str, color: str) -> None:
    xs, ys = thin_points(st.steps, values)
    if not ys:
        return _empty(ax)
    ax.plot(xs, ys, color=color, lw=1.2, marker="o" if len(ys) < 3 else None, ms=3)  # one point is a dot
    if st.total_steps:
        ax.set_xlim(0, max(st.total_steps, xs[-1]))
    style_axes(ax, title, "step", ylabel)


def draw_loss(ax, st: DashState) -> None:
    draw_series(ax, st, st.loss, "loss", "", "tab:blue")
    xs, ys = thin_points(st.eval_steps, st.eval_loss)
    if ys:  # held-out loss (`eval` events) beside the training loss
        ax.plot(xs, ys, color="tab:orange", lw=1.2, marker="o", ms=3, label="eval")
        ax.lines[0].set_label("train")
        ax.legend(fontsize=7)


def rolling_mean(values: list, window: int = ROUTING_WINDOW) -> list:
    """The mean of the last `window` values at each point (missing values skipped; None until one exists)."""
    out, recent = [], []
    for v in values:
        recent = (recent + ([v] if v is not None else []))[-window:]
        out.append(sum(recent) / len(recent) if recent else None)
    return out


def draw_throughput(ax, st: DashState) -> None:
    """Every step faint, the mean of the last ROUTING_WINDOW steps, and the run's average dashed."""
    draw_series(ax, st, st.tokens_per_s_per_gpu, f"tokens/s per {st.per}", "", "tab:green")
    if not any(v is not None for v in st.tokens_per_s_per_gpu):
        return
    ax.lines[0].set(alpha=0.3, lw=0.8, label="each step")
    ax.plot(*thin_points(st.steps, rolling_mean(st.tokens_per_s_per_gpu)), color="tab:green", lw=1.6,
            label=f"mean of last {ROUTING_WINDOW}")
    run = st.throughput()["run"]
    ax.axhline(run, color="0.3", ls="--", lw=1, label=f"run mean {run:,.0f}")
    ax.legend(fontsize=6, loc="lower right")


def draw_lines(ax, st: DashState, series: list, title: str, ylabel: str = "", log: bool = False) -> None:
    """Several per-step series on one Axes: [(values, label, color), ...]; a series without values is left out."""
    drawn = 0
    for values, label, color in series:
        xs, ys = thin_points(st.steps, values)
        if ys:
            ax.plot(xs, ys, color=color, lw=1.2, label=label, marker="o" if len(ys) < 3 else None, ms=3)
            drawn += 1
    if not drawn:
        return _empty(ax)
    if log and all(y > 0 for line in ax.lines for y in line.get_ydata()):
        ax.set_yscale("log")
    if st.total_steps:
        ax.set_xlim(0, max(st.total_steps, st.steps[-1]))
    style_axes(ax, title, "step", ylabel)
    if drawn > 1:
        ax.legend(fontsize=6)


def draw_router_losses(ax, st: DashState) -> None:
    draw_lines(ax, st, [(st.aux_loss, "aux loss", "tab:brown"), (st.z_loss, "z-loss", "tab:pink")],
               "router losses")


def draw_grad_lr(ax, st: DashState) -> None:
    """Gradient norm, and the learning rate on a second axis."""
    draw_lines(ax, st, [(st.grad_norm, "grad norm", "tab:gray")], "grad norm (learning rate dotted)")
    xs, ys = thin_points(st.steps, st.lr)
    if ys and st.steps:
        twin = ax.twinx()
        twin.plot(xs, ys, color="tab:olive", lw=1.0, ls=":")
        twin.tick_params(labelsize=7, colors="tab:olive")
        twin.yaxis.get_offset_text().set_fontsize(7)


def mark_health(ax, st: DashState, layer: "int | None" = None) -> None:
    """Dead (red) and overloaded (orange) expert warnings (of one MoE layer, or all) as ticks along the top of a
    step axis."""
    colors = {"dead_expert": "tab:red", "overloaded_expert": "tab:orange"}
    for kind, color in colors.items():
        steps = [e.step for e in st.health_warnings() if e.kind == kind and e.step
                 and (layer is None or e.layer == layer)]
        if steps:
            ax.plot(steps, [1.0] * len(steps), "v", color=color, ms=5, clip_on=False,
                    transform=ax.get_xaxis_transform(), label=f"{kind.replace('_', ' ')} warning")


def mark_controls(ax, st: DashState) -> None:
    """The changes made while the run trained (`control` events) as dotted purple lines at their step, named
    along the top (field=new)."""
    by_step: dict = {}
    for c in st.controls:
        name = str(c.field or "").rsplit(".", 1)[-1]
        by_step.setdefault(c.step or 0, []).append(f"{name}={c.new}")
    for step, names in by_step.items():
        ax.axvline(step, color="tab:purple", ls=":", lw=1.1)
        ax.text(step, 1.0, " " + ", ".join(names), transform=ax.get_xaxis_transform(), fontsize=6,
                color="tab:purple", va="top", ha="left", clip_on=True)


def draw_balance_history(ax, st: DashState) -> None:
    """max/mean and cv of the load per step (mean over MoE layers; dropped % when a capacity drops any), with
    the health warnings marked."""
    get = lambda k: [b[k] if b else None for b in st.balance_I]
    series = [(get("max_over_mean"), "max/mean", "tab:red"), (get("cv"), "cv", "tab:blue")]
    if any(d for d in st.dropped_pct_I if d):
        series.append((st.dropped_pct_I, "dropped %", "tab:gray"))
    draw_lines(ax, st, series, "load balance per step (mean over layers)")
    if st.balance_I:
        mark_health(ax, st)
        ax.legend(fontsize=6)


def draw_tflops(ax, st: DashState) -> None:
    mfu = st.last.mfu if st.last is not None else None
    title = f"TFLOPs per {st.per}" + (f" (MFU {100 * mfu:.1f}% at the last step)" if mfu is not None else "")
    draw_series(ax, st, st.tflops_per_gpu, title, "", "tab:purple")


def _memory_label(st: DashState) -> str:
    return "peak allocated GB" if st.memory_key == "peak_allocated_gb" else "peak RSS GB"


def draw_memory_ranks(ax, st: DashState) -> None:
    """Bars: the peak so far of every rank."""
    if not st.memory_peak_R:
        return _empty(ax)
    ranks = list(range(len(st.memory_peak_R)))
    ax.bar(ranks, st.memory_peak_R, color="tab:orange", width=0.7)
    ax.set_xticks(ranks if len(ranks) <= 16 else ranks[:: max(len(ranks) // 8, 1)])
    pad = max(0.0, (4 - len(ranks)) / 2)  # a lone rank's bar should not fill the panel
    ax.set_xlim(-0.5 - pad, len(ranks) - 0.5 + pad)
    style_axes(ax, f"memory per rank ({_memory_label(st)})", "rank", "")


def draw_memory_history(ax, st: DashState) -> None:
    """Lines: the max and the min over ranks at every step."""
    xs, hi = thin_points(st.steps[-len(st.memory_max):] if st.memory_max else [], st.memory_max)
    if not hi:
        return _empty(ax)
    ax.plot(xs, hi, color="tab:red", lw=1.2, label="max over ranks")
    if len(st.memory_peak_R) > 1:
        _, lo = thin_points(st.steps[-len(st.memory_min):], st.memory_min)
        ax.plot(xs, lo, color="tab:orange", lw=1.0, ls="--", label="min over ranks")
        ax.legend(fontsize=7)
    if st.total_steps:
        ax.set_xlim(0, max(st.total_steps, xs[-1]))
    style_axes(ax, f"memory over steps ({_memory_label(st)})", "step", "GB")


def draw_load_over_steps(ax, st: DashState, layer: int):
    """Expert x step for one MoE layer: each expert's tokens over the even share (1.0 = balanced, 0 = none);
    columns are single steps, or sums of neighbouring steps on long runs (StepBuckets); health warnings marked."""
    spans, load_BE = st.load_history.layer(layer)
    if not spans:
        return _empty(ax, "no routing yet")
    mean_B1 = load_BE.mean(-1, keepdims=True)
    rel_EB = np.divide(load_BE, mean_B1, out=np.zeros_like(load_BE), where=mean_B1 > 0).T
    top = max(2.0, float(rel_EB.max()))
    edges = [spans[0][0] - 0.5] + [b + 0.5 for _, b in spans]
    im = ax.pcolormesh(edges, np.arange(rel_EB.shape[0] + 1) - 0.5, rel_EB, cmap="RdBu_r",
                       norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top))
    ax.invert_yaxis()
    ax.set_title(f"{st.layer_name(layer)}: load / mean over steps", fontsize=9, loc="left")
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("expert", fontsize=8)
    ax.tick_params(labelsize=7)
    if st.total_steps:
        ax.set_xlim(edges[0], max(st.total_steps + 0.5, edges[-1]))
    mark_health(ax, st, layer)
    mark_controls(ax, st)
    ax.figure.colorbar(im, ax=ax, fraction=0.03, pad=0.01).ax.tick_params(labelsize=7)
    return im


def draw_heatmap(ax, st: DashState, window: bool = True):
    """Layer x expert: each expert's tokens relative to an even share (1.0 = balanced; 0 = dead)."""
    counts_ME = st.routing_ME(window)
    if not counts_ME:
        return _empty(ax, "no routing yet")
    load_ME = []
    for row in counts_ME:
        mean = sum(row) / len(row) if row and sum(row) > 0 else 1.0
        load_ME.append([c / mean for c in row])
    top = max(2.0, max(max(r) for r in load_ME))
    im = ax.imshow(load_ME, aspect="auto", cmap="RdBu_r", norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top),
                   interpolation="nearest")
    M, E = len(load_ME), len(load_ME[0])
    ax.set_yticks(range(0, M, max(M // 8, 1)))
    ax.set_xticks(range(0, E, max(E // 16, 1)))
    ax.set_title(f"routing load / mean, {st.span_text(window)}", fontsize=9, loc="left")
    ax.set_xlabel("expert", fontsize=8)
    ax.set_ylabel("MoE layer", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.figure.colorbar(im, ax=ax, fraction=0.05, pad=0.01).ax.tick_params(labelsize=7)
    return im


def balance_text(b: dict, num_experts: int) -> str:
    return (f"max/mean {b['max_over_mean']:.2f} · cv {b['cv']:.2f} · entropy {b['entropy']:.3f} · "
            f"dead {b['dead']}/{num_experts}")


def draw_experts(ax, st: DashState, layer: int, window: bool = True) -> None:
    """Bars: tokens per expert of one MoE layer, the even share dashed, dead experts in red."""
    counts_ME = st.routing_ME(window)
    if not counts_ME:
        return _empty(ax, "no routing yet")
    layer = min(max(layer, 0), len(counts_ME) - 1)
    counts = counts_ME[layer]
    total = sum(counts) or 1.0
    shares = [100 * c / total for c in counts]
    colors = ["tab:red" if c == 0 else "tab:blue" for c in counts]
    ax.bar(range(len(counts)), shares, color=colors, width=0.8)
    ax.axhline(100 / len(counts), color="0.3", ls="--", lw=1)
    ax.set_xticks(range(0, len(counts), max(len(counts) // 16, 1)))
    b = st.layer_balance(layer, window)
    style_axes(ax, f"{st.layer_name(layer)}, {st.span_text(window)}:\n{balance_text(b, len(counts))}", "expert",
               "% of tokens")


# ---------------------------------------------------------------------- figures
def training_figure(st: DashState, dpi: int = 80) -> Figure:
    """The dashboard's top chart: loss, throughput, TFLOPs, memory over steps; router losses, grad norm and
    learning rate, load balance with the health warnings, memory per rank."""
    fig = new_figure(12, 4.4, dpi)
    (a, b, c, d), (e, f, g, h) = fig.subplots(2, 4)
    draw_loss(a, st)
    draw_throughput(b, st)
    draw_tflops(c, st)
    draw_memory_history(d, st)
    draw_router_losses(e, st)
    draw_grad_lr(f, st)
    draw_balance_history(g, st)
    draw_memory_ranks(h, st)
    if st.controls and st.steps:
        for ax in (a, b, c, d, e, f, g):  # every chart over steps
            mark_controls(ax, st)
    return fig


def routing_figure(st: DashState, layer: int, window: bool = True, dpi: int = 80) -> Figure:
    """The dashboard's routing chart: the layer x expert heatmap and one layer's histogram, and below them that
    layer's load over steps."""
    top_h = max(2.4, 0.9 + 0.22 * st.num_layers)
    fig = new_figure(12, top_h + 2.6, dpi)
    upper, lower = fig.subfigures(2, 1, height_ratios=[top_h, 2.6])
    ax1, ax2 = upper.subplots(1, 2, width_ratios=[1.1, 1])
    draw_heatmap(ax1, st, window)
    draw_experts(ax2, st, layer, window)
    draw_load_over_steps(lower.subplots(), st, layer)
    return fig


def sweep_figure(states: list, labels: list, dpi: int = 80) -> Figure:
    """The runs of a sweep overlaid: loss, tokens/s per GPU (mean of the last ROUTING_WINDOW steps) and
    max/mean load (mean over layers), one line per run."""
    fig = new_figure(12, 2.4, dpi)
    axes = fig.subplots(1, 3)
    per = states[0].per if states else "GPU"
    panels = [(lambda st: st.loss, "loss", ""), (lambda st: rolling_mean(st.tokens_per_s_per_gpu),
              f"tokens/s per {per} (mean of last {ROUTING_WINDOW})", ""),
              (lambda st: [b["max_over_mean"] if b else None for b in st.balance_I], "max/mean load per step", "")]
    for ax, (values, title, ylabel) in zip(axes, panels):
        drawn = False
        for i, (st, label) in enumerate(zip(states, labels)):
            xs, ys = thin_points(st.steps, values(st))
            if ys:
                ax.plot(xs, ys, lw=1.2, label=label, color=f"C{i % 10}", marker="o" if len(ys) < 3 else None, ms=3)
                drawn = True
        if not drawn:
            _empty(ax)
            continue
        style_axes(ax, title, "step", ylabel)
    if axes[0].lines:
        axes[0].legend(fontsize=6)
    return fig


def _state(run) -> DashState:
    return run if isinstance(run, DashState) else load_state(run)


def plot_throughput(run) -> Figure:
    """Loss, tokens/s per GPU and TFLOPs per GPU over steps. `run`: a Run, a run folder or a DashState."""
    st = _state(run)
    fig = new_figure(12, 3.2, 90)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    draw_loss(ax1, st)
    draw_throughput(ax2, st)
    draw_tflops(ax3, st)
    fig.suptitle(f"{st.name or 'run'}: {st.status}, step {st.step}/{st.total_steps}", fontsize=10)
    return fig


def plot_memory(run) -> Figure:
    """Memory over steps (max and min over ranks) and every rank's peak."""
    st = _state(run)
    fig = new_figure(10, 3.2, 90)
    ax1, ax2 = fig.subplots(1, 2)
    draw_memory_history(ax1, st)
    draw_memory_ranks(ax2, st)
    fig.suptitle(f"{st.name or 'run'}: memory", fontsize=10)
    return fig


def plot_routing(run, layer: "int | None" = None) -> Figure:
    """The whole run's routing: layer x expert heatmap, and tokens per expert of `layer` (an MoE layer index;
    default the least balanced one) with its imbalance metrics."""
    st = _state(run)
    layer = st.worst_layer(window=False) if layer is None else layer
    if st.num_layers and not 0 <= layer < st.num_layers:
        from moelab.config import ConfigError

        raise ConfigError(f"layer={layer} is not an MoE layer index of this run; use 0..{st.num_layers - 1}")
    fig = routing_figure(st, layer, window=False, dpi=90)
    fig.suptitle(f"{st.name or 'run'}: routing over {len(st.steps)} steps", fontsize=10)
    return fig


def write_report(run, out: "str | Path | None" = None) -> list[Path]:
    """Write throughput.png, memory.png and routing.png for a run folder (default into FOLDER/report/)."""
    st = _state(run)
    folder = Path(getattr(run, "folder", run)) if not isinstance(run, DashState) else Path(".")
    out = check_path("out", out if out is not None else folder / "report", "folder to write",
                     "give a folder for the PNG files (moelab report RUN --out FOLDER)")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fn in (("throughput", plot_throughput), ("memory", plot_memory), ("routing", plot_routing)):
        path = out / f"{name}.png"
        fn(st).savefig(path)
        paths.append(path)
    return paths
