"""The notebook view: ipywidgets fed from `DashState`s.

Thread rules (verified in JupyterLab 4, see the monitor): `update()` runs on the monitor's daemon thread and only
assigns trait values; charts are drawn with matplotlib's Agg canvas into `widgets.Image` PNG bytes, at most every
`chart_every_s` and only when the state changed. Button and dropdown callbacks run on the kernel's main thread.
"""
from __future__ import annotations

import html
import threading
import time

import ipywidgets as w

from moelab.live import plots
from moelab.live.state import ROUTING_WINDOW, DashState, fmt_duration, fmt_tflops, or_unknown

STATUS_COLORS = {"RUNNING": "#1f77b4", "COMPLETED": "#2ca02c", "PENDING": "#7f7f7f", "WAITING": "#7f7f7f"}
BAR_STYLES = {"RUNNING": "info", "COMPLETED": "success"}


def badge(status: str) -> str:
    color = STATUS_COLORS.get(status, "#d62728")
    return (f"<span style='background:{color};color:white;border-radius:3px;padding:1px 6px;"
            f"font-size:11px;font-weight:600'>{html.escape(status)}</span>")


def _cell(label: str, value: str) -> str:
    return (f"<div style='padding:2px 14px 2px 0'><div style='color:#777;font-size:10px'>{label}</div>"
            f"<div style='font-size:13px;font-weight:600'>{value}</div></div>")


def stats_html(st: DashState) -> str:
    """A row of labelled numbers: loss (last step); throughput and TFLOPs as the mean of the last
    ROUTING_WINDOW steps with the run's mean below; MFU (or why there is none); peak memory per rank; dropped
    tokens; s/step; expert health now; status."""
    last = st.last
    num = lambda key, fmt: fmt(getattr(last, key)) if last is not None and getattr(last, key) is not None else "–"
    mem = "–"
    if st.memory_peak_R:
        per = st.memory_peak_R
        mem = (" · ".join(f"r{r} {v:.2f}" for r, v in enumerate(per)) if len(per) <= 4
               else f"max {max(per):.2f} (r{per.index(max(per))}) · min {min(per):.2f}") + " GB"
    sps = st.seconds_per_step()
    cells = [_cell("loss", num("loss", lambda x: f"{x:.4g}")),
             _rate_cell(st, "tokens_per_s_per_gpu", f"tokens/s/{st.per}", lambda x: f"{x:,.0f}"),
             _rate_cell(st, "tflops_per_gpu", f"TFLOPs/{st.per}", fmt_tflops),
             _cell("MFU", html.escape(st.mfu_text())),
             _cell("peak memory per rank", mem),
             _cell("dropped", f"{st.dropped_pct:.1f}%" if st.dropped_pct is not None else "–"),
             _cell("s/step", f"{sps:.2f}" if sps else "–"),
             _cell("experts now", html.escape(st.health_now())),
             _cell("status", html.escape(st.status))]
    return f"<div style='display:flex;flex-wrap:wrap'>{''.join(cells)}</div>"


def _rate_cell(st: DashState, key: str, label: str, fmt) -> str:
    t = st.throughput(key)
    if t["recent"] is None:
        return _cell(label, "–")
    note = f"last {min(ROUTING_WINDOW, len(st.steps))} steps · run mean {fmt(t['run'])} · last step {fmt(t['last'])}"
    return _cell(label, f"{fmt(t['recent'])}<div style='color:#777;font-size:9px;font-weight:400'>{note}</div>")


def progress_html(st: DashState) -> str:
    if not st.total_steps and not st.steps:  # no start event yet: the job is queued or starting
        return f"<span style='font-size:12px'>waiting for the job to start ({html.escape(st.status)})</span>"
    parts = [f"<b>{st.step}</b> / {st.total_steps or '?'} steps"]
    if st.eta_s() is not None:
        parts.append(f"ETA {fmt_duration(st.eta_s())}")
    if st.first_time:
        parts.append(f"elapsed {fmt_duration(st.elapsed_s())}")
    return f"<span style='font-size:12px'>{' · '.join(parts)}</span>"


def _box(color: str, background: str, body: str) -> str:
    return (f"<div style='border-left:4px solid {color};background:{background};padding:3px 8px;margin:2px 0;"
            f"font-size:12px'>{body}</div>")


def health_html(st: DashState) -> str:
    """The experts' health: the present state first (from the last step), the warning history folded below it,
    so that a warning from step 2 does not read as the state of step 200."""
    history = st.health_warnings()
    now = st.health_now()
    if not history and now in ("healthy", "–"):
        return ""
    lines = "<br>".join(html.escape(f"step {or_unknown(e.step)}: {e.message}") for e in history[-10:])
    more = f" (latest 10 of {len(history)})" if len(history) > 10 else ""
    folded = (f"<details><summary>{len(history)} health warning(s) so far, last at step "
              f"{or_unknown(history[-1].step)}{more}</summary>{lines}</details>") if history else ""
    if now == "healthy":
        return _box("#2ca02c", "#eef7ee", f"<b>experts healthy now</b> (at step {st.step}){folded}")
    return _box("#ff9800", "#fff4e5", f"<b>experts now: {html.escape(now)}</b> (at step {st.step}){folded}")


def messages_html(st: DashState) -> str:
    """Errors (with the traceback folded), expert health (now, then history), other warnings and corrupt lines;
    empty when all is well."""
    out = []
    if st.failed and (st.error_text() or st.status != "CANCELLED"):  # a plain cancel: the badge says it all
        first, _, rest = (st.error_text() or f"the run ended with status {st.status}").partition("\n")
        detail = st.errors[0].traceback if st.errors else rest  # a Run's error: its stderr tail
        body = f"<b>{html.escape(st.status)}</b>: {html.escape(first)}"
        if detail.strip():
            body += ("<details><summary>traceback</summary><pre style='font-size:11px'>"
                     f"{html.escape(detail)}</pre></details>")
        out.append(_box("#d62728", "#fdecea", body))
    out.append(health_html(st))
    others = [e for e in st.warnings if e not in st.health_warnings()]
    if others:
        shown = others[-3:]
        lines = "<br>".join(html.escape(f"step {or_unknown(e.step)}: {e.kind or 'warning'}: {e.message}")
                            for e in shown)
        more = f" (latest {len(shown)} of {len(others)})" if len(others) > len(shown) else ""
        out.append(_box("#ff9800", "#fff4e5", f"<b>warnings{more}</b><br>{lines}"))
    if st.corrupt:
        lines = "<br>".join(html.escape(m) for m in st.corrupt[:2])
        out.append(_box("#ff9800", "#fff4e5", f"<b>{len(st.corrupt)} corrupt metrics line(s) skipped</b><br>{lines}"))
    return "".join(out)


class RunPanel:
    """The widgets of one run: header and Cancel, progress, stats, training chart, layer selector with the
    balance of that layer, routing chart, messages."""

    def __init__(self, cancel=None, chart_every_s: float = 1.0, lock=None, run=None):
        self.chart_every_s = chart_every_s
        # a Run (not a bare folder): its live controls, Checkpoint now and Fork here (moelab.live.controls)
        self.controls = None
        if callable(getattr(run, "set", None)):
            from moelab.live.controls import ControlsBar

            self.controls = ControlsBar(run)
        self.lock = lock or threading.RLock()  # shared with the monitor: callbacks must not draw a state mid-fold
        self.visible = True  # a sweep draws charts only for the tab on screen (and every tab at the end)
        self.header = w.HTML()
        self.cancel_button = w.Button(description="Cancel", icon="stop", button_style="danger",
                                      tooltip="cancel this run", layout=w.Layout(width="100px"),
                                      disabled=cancel is None)
        self.progress = w.IntProgress(value=0, min=0, max=1, bar_style="info", layout=w.Layout(width="55%"))
        self.progress_text = w.HTML()
        self.stats = w.HTML("waiting for the first metrics…")
        # Before the first data: a line of text, no empty images (a browser draws those as broken icons) and no
        # empty layer selector; each appears with its first content.
        self.placeholder = w.HTML("<span style='color:#777;font-size:12px'>charts appear with the first step"
                                  "</span>")
        self.train_chart = w.Image(format="png", layout=w.Layout(max_width="100%", display="none"))
        self.layer = w.Dropdown(options=[], description="layer", layout=w.Layout(width="200px", display="none"),
                                style={"description_width": "initial"})
        self.balance = w.HTML()
        self.routing_chart = w.Image(format="png", layout=w.Layout(max_width="100%", display="none"))
        self.routing_chart.add_class("moelab-routing")  # found by the browser test
        self.messages = w.HTML()
        self.box = w.VBox([
            w.HBox([self.header, self.cancel_button],
                   layout=w.Layout(justify_content="space-between", align_items="center")),
            w.HBox([self.progress, self.progress_text], layout=w.Layout(align_items="center")),
            *([self.controls.box] if self.controls else []), self.stats, self.messages, self.placeholder, self.train_chart,
            w.HBox([self.layer, self.balance], layout=w.Layout(align_items="center")),
            self.routing_chart,
        ], layout=w.Layout(padding="4px"))
        self._cancel = cancel
        self._state: DashState | None = None
        self._filling_options = False
        self._notes = ""  # what a callback has to say (a failed cancel), kept across updates
        self._drawn = {"train": (-1, 0.0), "routing": (-1, 0.0)}  # chart -> (state version, time drawn)
        self.cancel_button.on_click(self._on_cancel)
        self.layer.observe(self._on_layer, names="value")

    def widgets(self) -> list:
        return [self.header, self.cancel_button, self.progress, self.progress_text, self.stats, self.placeholder,
                self.train_chart, self.layer, self.balance, self.routing_chart, self.messages,
                *(self.controls.widgets() if self.controls else [])]

    # ------------------------------------------------------------------ callbacks (kernel main thread)
    def _on_cancel(self, _button) -> None:
        self.cancel_button.disabled = True
        self.cancel_button.description = "Cancelling"
        try:
            self._cancel()
        except Exception as e:  # shown, not raised: a callback's exception would only reach the log
            self._notes = f"<div style='color:#d62728'>cancel failed: {html.escape(str(e))}</div>"
            self.messages.value += self._notes

    def _on_layer(self, change) -> None:
        if self._state is not None and change["new"] is not None and not self._filling_options:
            with self.lock:
                self._draw_routing(self._state, force=True, redraw=True)

    # ------------------------------------------------------------------ drawing
    def update(self, st: DashState, final: bool = False) -> None:
        self._state = st
        self.header.value = f"<b style='font-size:14px'>{html.escape(st.name or 'run')}</b> &nbsp;{badge(st.status)}"
        self.progress.max = max(st.total_steps, 1)
        self.progress.value = min(st.step, self.progress.max)
        self.progress.bar_style = BAR_STYLES.get(st.status, "info" if not st.done else "danger")
        self.progress_text.value = progress_html(st)
        if st.last or st.done:
            self.stats.value = stats_html(st)
        self.messages.value = messages_html(st) + self._notes
        if self.controls:
            self.controls.show(st.controls)
        if st.done:
            if self.controls:
                self.controls.finished(st.status)
            self.cancel_button.disabled = True
            self.cancel_button.description = "Done" if st.status == "COMPLETED" else st.status.title()
        if st.num_layers and len(self.layer.options) != st.num_layers:
            self._filling_options = True
            try:
                self.layer.options = [(st.layer_name(i), i) for i in range(st.num_layers)]
                self.layer.value = st.worst_layer()
                self.layer.layout.display = None
            finally:
                self._filling_options = False
        if self.visible or final:
            self._draw_train(st, final)
            self._draw_routing(st, force=final)

    def _due(self, chart: str, st: DashState, force: bool) -> bool:
        version, at = self._drawn[chart]
        return version != st.version and (force or version < 0 or time.monotonic() - at >= self.chart_every_s)

    def _draw_train(self, st: DashState, force: bool) -> None:
        if st.steps and self._due("train", st, force):
            self.train_chart.value = plots.to_png(plots.training_figure(st))
            self.train_chart.layout.display = None
            self.placeholder.layout.display = "none"
            self._drawn["train"] = (st.version, time.monotonic())

    def _draw_routing(self, st: DashState, force: bool, redraw: bool = False) -> None:
        """force: draw now if the state changed; redraw: draw even if not (another layer was picked)."""
        layer = self.layer.value
        if layer is None or not st.num_layers:
            return
        if redraw:
            self._drawn["routing"] = (-1, 0.0)
        if self._due("routing", st, force):
            self.routing_chart.value = plots.to_png(plots.routing_figure(st, layer))
            self.routing_chart.layout.display = None
            balance = plots.balance_text(st.layer_balance(layer), len(st.routing_ME()[layer]))
            self.balance.value = (f"<span style='font-size:12px;padding-left:10px'>{st.span_text()} (mean over "
                                  f"steps): {balance}</span>")
            self._drawn["routing"] = (st.version, time.monotonic())


def sweep_labels(names: list) -> tuple:
    """(tab titles, what varies) from a sweep's run names ("00-aux_loss_coeff=0.01,bias_update_rate=0"): the
    titles keep only the swept values ("0.01, 0"), which a tab has room for; other names stay as they are."""
    parsed = []
    for name in map(str, names):
        head, sep, rest = name.partition("-")
        pairs = [p.partition("=") for p in rest.split(",")] if sep and head.isdigit() else []
        if not pairs or not all(p[1] for p in pairs):
            return [str(n) for n in names], ""
        parsed.append(pairs)
    keys = [k for k, _, _ in parsed[0]] if parsed else []
    return [", ".join(v for _, _, v in pairs) for pairs in parsed], ", ".join(keys)


def sweep_table_html(states: list, labels: "list | None" = None) -> str:
    per = states[0].per if states else "GPU"
    head = ("run", "status", "step", "loss", f"tokens/s/{per}", "max/mean", "cv", "entropy", "dead")
    rows = []
    for st, label in zip(states, labels or [st.name for st in states]):
        b = st.balance_summary()
        rate = st.throughput()["recent"]
        cells = [html.escape(label), badge(st.status), f"{st.step}/{st.total_steps or '?'}",
                 f"{st.last.loss:.4g}" if st.last is not None and st.last.loss is not None else "–",
                 f"{rate:,.0f}" if rate is not None else "–",
                 *((f"{b['max_over_mean']:.2f}", f"{b['cv']:.2f}", f"{b['entropy']:.3f}", str(b["dead"]))
                   if b else ("–",) * 4)]
        rows.append("<tr>" + "".join(f"<td style='padding:1px 10px'>{c}</td>" for c in cells) + "</tr>")
    th = "".join(f"<th style='padding:1px 10px;text-align:left'>{h}</th>" for h in head)
    return (f"<table style='font-size:12px;border-collapse:collapse'><tr>{th}</tr>{''.join(rows)}</table>"
            f"<div style='color:#777;font-size:10px'>tokens/s/GPU: mean of the last {ROUTING_WINDOW} steps; "
            "max/mean, cv, entropy: per step, mean over MoE layers, then over the whole run so far (as compare() "
            "and summary.json); dead: experts dead at the last step</div>")


# The snapshot output sits below the live widget and is hidden while the widget renders beside it; where the
# widget cannot render (a reopened notebook without widget state, an HTML export) it is what shows.
SNAPSHOT_CSS = ("<style>.jp-OutputArea-child:has(.widget-vbox) ~ .jp-OutputArea-child .moelab-snapshot,"
                ".output_area:has(.widget-vbox) ~ .output_area .moelab-snapshot {display:none}</style>")


def _img(png: bytes) -> str:
    import base64

    return f"<img style='max-width:100%' src='data:image/png;base64,{base64.b64encode(png).decode()}'/>" if png else ""


class WidgetView:
    """One run: its panel. Several runs (a sweep): a comparison table, curves of every run overlaid, Cancel all,
    and a tab per run (titled by its swept values).

        view = WidgetView(["tiny"], [run.cancel])
        view.display()                    # in a notebook: the widget, and a place for the final snapshot
        view.update([state], final=True)  # from the monitor thread
        view.resync(final=True)           # from the main thread: re-send, and leave the static snapshot
    """

    def __init__(self, names: list, cancels: list, cancel_all=None, chart_every_s: float = 1.0, runs=None):
        self.lock = threading.RLock()  # the monitor holds it while it folds events and updates the view
        self.chart_every_s = chart_every_s
        runs = runs or [None] * len(cancels)
        self.panels = [RunPanel(c, chart_every_s, self.lock, r) for c, r in zip(cancels, runs)]
        self.answered_while_busy = False  # set by display()
        self.table = self.tabs = self.header = self.cancel_all = self.overlay = None
        self._snapshot = None  # the display handle of the snapshot output
        self._states: list = []
        if len(self.panels) == 1:
            self.box = self.panels[0].box
            return
        self.labels, self.varied = sweep_labels(names)
        self.header = w.HTML()
        self.cancel_all = w.Button(description="Cancel all", icon="stop", button_style="danger",
                                   disabled=cancel_all is None, layout=w.Layout(width="110px"))
        self.cancel_all.on_click(lambda _b: cancel_all())
        self.table = w.HTML()
        self.overlay = w.Image(format="png", layout=w.Layout(max_width="100%", display="none"))
        self._overlay_drawn = (None, 0.0)
        self.tabs = w.Tab(children=[p.box for p in self.panels], titles=self.labels)
        self.tabs.observe(self._on_tab, names="selected_index")
        self._on_tab({"new": 0})
        self.box = w.VBox([w.HBox([self.header, self.cancel_all],
                                  layout=w.Layout(justify_content="space-between", align_items="center")),
                           self.table, self.overlay, self.tabs])

    def _on_tab(self, change) -> None:
        with self.lock:
            for i, p in enumerate(self.panels):
                p.visible = i == change["new"]
                if p.visible and p._state is not None:
                    p.update(p._state)

    def update(self, states: list, final: bool = False) -> None:
        self._states = states
        for panel, st in zip(self.panels, states):
            panel.update(st, final)
        if self.table is not None:
            done = sum(st.done for st in states)
            over = f" over {html.escape(self.varied)}" if self.varied else ""
            self.header.value = (f"<b style='font-size:14px'>sweep of {len(states)} runs{over}</b> "
                                 f"&nbsp;{done} finished")
            self.table.value = sweep_table_html(states, self.labels)
            if done == len(states):
                self.cancel_all.disabled = True
            versions, at = self._overlay_drawn
            now = time.monotonic()
            if any(st.steps for st in states) and versions != [st.version for st in states] and (
                    final or versions is None or now - at >= self.chart_every_s):
                self.overlay.value = plots.to_png(plots.sweep_figure(states, self.labels))
                self.overlay.layout.display = None
                self._overlay_drawn = ([st.version for st in states], now)

    def widgets(self) -> list:
        own = [x for x in (self.header, self.cancel_all, self.table, self.overlay, self.tabs) if x is not None]
        return own + [x for p in self.panels for x in p.widgets()]

    def snapshot_html(self) -> str:
        """The dashboard as static HTML (text and PNG images), as it stands."""
        if self.table is None:
            p = self.panels[0]
            parts = [p.header.value, p.progress_text.value, p.stats.value, p.messages.value, p.balance.value,
                     _img(p.train_chart.value), _img(p.routing_chart.value)]
        else:
            parts = [self.header.value, self.table.value, _img(self.overlay.value)]
        parts = [f"<div>{x}</div>" for x in parts if x]
        note = ("<div style='color:#777;font-size:10px'>a static snapshot of the dashboard at its end (the live "
                "widget needs the kernel that drew it)</div>")
        return f"{SNAPSHOT_CSS}<div class='moelab-snapshot'>{note}{''.join(parts)}</div>"

    def resync(self, final: bool = False) -> None:
        """Re-send every widget's state from the calling (main) thread: headless executors record only messages
        of the cell that is running, so `Dashboard.wait()` calls this before it returns. `final` (every run
        ended): also fill the snapshot output, so that a reopened or exported notebook shows the dashboard."""
        for x in self.widgets():
            x.send_state()
        if final and self._snapshot is not None:
            from IPython.display import HTML

            with self.lock:
                html_text = self.snapshot_html()
            self._snapshot.update(HTML(html_text))

    def display(self) -> None:
        from IPython.display import HTML, display

        from moelab.live.kernel import answer_while_busy

        # Cancel, the layer selector and the tabs answer while a cell blocks (run.wait()): their messages go to
        # a kernel subshell (moelab.live.kernel); `answered_while_busy` says whether this kernel allows it
        self.answered_while_busy = answer_while_busy(self.widgets())
        display(self.box)
        self._snapshot = display(HTML(""), display_id=True)  # filled by resync(final=True)
