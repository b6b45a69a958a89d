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
from moelab.live.state import DashState, fmt_duration, fmt_tflops

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
    """A row of labelled numbers from the latest step: loss, throughput, TFLOPs, MFU, peak memory per rank."""
    last = st.last
    num = lambda key, fmt: fmt(last[key]) if last.get(key) is not None else "–"
    mem = "–"
    if st.memory_peak_R:
        per = st.memory_peak_R
        mem = (" · ".join(f"r{r} {v:.2f}" for r, v in enumerate(per)) if len(per) <= 4
               else f"max {max(per):.2f} (r{per.index(max(per))}) · min {min(per):.2f}") + " GB"
    sps = st.seconds_per_step()
    cells = [_cell("loss", num("loss", lambda x: f"{x:.4g}")),
             _cell("tokens/s/GPU", num("tokens_per_s_per_gpu", lambda x: f"{x:,.0f}")),
             _cell("TFLOPs/GPU", num("tflops_per_gpu", fmt_tflops)),
             _cell("MFU", num("mfu", lambda x: f"{100 * x:.1f}%")),
             _cell("peak memory per rank", mem),
             _cell("dropped", f"{st.dropped_pct:.1f}%" if st.dropped_pct is not None else "–"),
             _cell("s/step", f"{sps:.2f}" if sps else "–"),
             _cell("status", html.escape(st.status))]
    return f"<div style='display:flex;flex-wrap:wrap'>{''.join(cells)}</div>"


def progress_html(st: DashState) -> str:
    parts = [f"<b>{st.step}</b> / {st.total_steps or '?'} steps"]
    if st.eta_s() is not None:
        parts.append(f"ETA {fmt_duration(st.eta_s())}")
    if st.first_time:
        parts.append(f"elapsed {fmt_duration(st.elapsed_s())}")
    return f"<span style='font-size:12px'>{' · '.join(parts)}</span>"


def messages_html(st: DashState) -> str:
    """Errors (with the traceback folded), health warnings and corrupt lines; empty when all is well."""
    out = []
    box = "<div style='border-left:4px solid {};background:{};padding:3px 8px;margin:2px 0;font-size:12px'>{}</div>"
    if st.failed and (st.error_text() or st.status != "CANCELLED"):  # a plain cancel: the badge says it all
        first, _, rest = (st.error_text() or f"the run ended with status {st.status}").partition("\n")
        detail = st.errors[0].get("traceback", "") if st.errors else rest  # a Run's error: its stderr tail
        body = f"<b>{html.escape(st.status)}</b>: {html.escape(first)}"
        if detail.strip():
            body += ("<details><summary>traceback</summary><pre style='font-size:11px'>"
                     f"{html.escape(detail)}</pre></details>")
        out.append(box.format("#d62728", "#fdecea", body))
    if st.warnings:
        shown = st.warnings[-3:]
        lines = "<br>".join(html.escape(f"step {e.get('step', '?')}: {e.get('kind', 'warning')}: "
                                        f"{e.get('message', '')}") for e in shown)
        more = f" (latest {len(shown)} of {len(st.warnings)})" if len(st.warnings) > len(shown) else ""
        out.append(box.format("#ff9800", "#fff4e5", f"<b>warnings{more}</b><br>{lines}"))
    if st.corrupt:
        lines = "<br>".join(html.escape(m) for m in st.corrupt[:2])
        out.append(box.format("#ff9800", "#fff4e5",
                              f"<b>{len(st.corrupt)} corrupt metrics line(s) skipped</b><br>{lines}"))
    return "".join(out)


class RunPanel:
    """The widgets of one run: header and Cancel, progress, stats, training chart, layer selector with the
    balance of that layer, routing chart, messages."""

    def __init__(self, cancel=None, chart_every_s: float = 1.0, lock=None):
        self.chart_every_s = chart_every_s
        self.lock = lock or threading.RLock()  # shared with the monitor: callbacks must not draw a state mid-fold
        self.visible = True  # a sweep draws charts only for the tab on screen (and every tab at the end)
        self.header = w.HTML()
        self.cancel_button = w.Button(description="Cancel", icon="stop", button_style="danger",
                                      tooltip="cancel this run", layout=w.Layout(width="100px"),
                                      disabled=cancel is None)
        self.progress = w.IntProgress(value=0, min=0, max=1, bar_style="info", layout=w.Layout(width="55%"))
        self.progress_text = w.HTML()
        self.stats = w.HTML("waiting for the first metrics…")
        self.train_chart = w.Image(format="png", layout=w.Layout(max_width="100%"))
        self.layer = w.Dropdown(options=[], description="histogram of", layout=w.Layout(width="240px"),
                                style={"description_width": "initial"})
        self.balance = w.HTML()
        self.routing_chart = w.Image(format="png", layout=w.Layout(max_width="100%"))
        self.messages = w.HTML()
        self.box = w.VBox([
            w.HBox([self.header, self.cancel_button],
                   layout=w.Layout(justify_content="space-between", align_items="center")),
            w.HBox([self.progress, self.progress_text], layout=w.Layout(align_items="center")),
            self.stats, self.messages, self.train_chart,
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
        return [self.header, self.cancel_button, self.progress, self.progress_text, self.stats,
                self.train_chart, self.layer, self.balance, self.routing_chart, self.messages]

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
        if st.done:
            self.cancel_button.disabled = True
            self.cancel_button.description = "Done" if st.status == "COMPLETED" else st.status.title()
        if st.num_layers and len(self.layer.options) != st.num_layers:
            self._filling_options = True
            try:
                self.layer.options = [(st.layer_name(i), i) for i in range(st.num_layers)]
                self.layer.value = st.worst_layer()
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
            balance = plots.balance_text(st.layer_balance(layer), len(st.routing_LE()[layer]))
            self.balance.value = (f"<span style='font-size:12px;padding-left:10px'>last {len(st.routing_window)} "
                                  f"steps: {balance}</span>")
            self._drawn["routing"] = (st.version, time.monotonic())


def sweep_table_html(states: list) -> str:
    head = ("run", "status", "step", "loss", "tokens/s/GPU", "max/mean", "cv", "entropy", "dead")
    rows = []
    for st in states:
        b = st.balance_summary()
        last = st.last
        cells = [html.escape(st.name), badge(st.status), f"{st.step}/{st.total_steps or '?'}",
                 f"{last['loss']:.4g}" if last.get("loss") is not None else "–",
                 f"{last['tokens_per_s_per_gpu']:,.0f}" if last.get("tokens_per_s_per_gpu") is not None else "–",
                 *((f"{b['max_over_mean']:.2f}", f"{b['cv']:.2f}", f"{b['entropy']:.3f}", str(b["dead"]))
                   if b else ("–",) * 4)]
        rows.append("<tr>" + "".join(f"<td style='padding:1px 10px'>{c}</td>" for c in cells) + "</tr>")
    th = "".join(f"<th style='padding:1px 10px;text-align:left'>{h}</th>" for h in head)
    return (f"<table style='font-size:12px;border-collapse:collapse'><tr>{th}</tr>{''.join(rows)}</table>"
            "<div style='color:#777;font-size:10px'>balance: mean over MoE layers of the whole run so far</div>")


class WidgetView:
    """One run: its panel. Several runs (a sweep): a comparison table, Cancel all, and a tab per run."""

    def __init__(self, names: list, cancels: list, cancel_all=None, chart_every_s: float = 1.0):
        self.lock = threading.RLock()  # the monitor holds it while it folds events and updates the view
        self.panels = [RunPanel(c, chart_every_s, self.lock) for c in cancels]
        self.answered_while_busy = False  # set by display()
        self.table = self.tabs = self.header = self.cancel_all = None
        if len(self.panels) == 1:
            self.box = self.panels[0].box
            return
        self.header = w.HTML()
        self.cancel_all = w.Button(description="Cancel all", icon="stop", button_style="danger",
                                   disabled=cancel_all is None, layout=w.Layout(width="110px"))
        self.cancel_all.on_click(lambda _b: cancel_all())
        self.table = w.HTML()
        self.tabs = w.Tab(children=[p.box for p in self.panels], titles=[str(n) for n in names])
        self.tabs.observe(self._on_tab, names="selected_index")
        self._on_tab({"new": 0})
        self.box = w.VBox([w.HBox([self.header, self.cancel_all],
                                  layout=w.Layout(justify_content="space-between", align_items="center")),
                           self.table, self.tabs])

    def _on_tab(self, change) -> None:
        with self.lock:
            for i, p in enumerate(self.panels):
                p.visible = i == change["new"]
                if p.visible and p._state is not None:
                    p.update(p._state)

    def update(self, states: list, final: bool = False) -> None:
        for panel, st in zip(self.panels, states):
            panel.update(st, final)
        if self.table is not None:
            done = sum(st.done for st in states)
            self.header.value = f"<b style='font-size:14px'>sweep of {len(states)} runs</b> &nbsp;{done} finished"
            self.table.value = sweep_table_html(states)
            if done == len(states):
                self.cancel_all.disabled = True

    def widgets(self) -> list:
        own = [x for x in (self.header, self.cancel_all, self.table, self.tabs) if x is not None]
        return own + [x for p in self.panels for x in p.widgets()]

    def resync(self) -> None:
        """Re-send every widget's state from the calling (main) thread: headless executors record only messages
        of the cell that is running, so `Dashboard.wait()` calls this before it returns."""
        for x in self.widgets():
            x.send_state()

    def display(self) -> None:
        from IPython.display import display

        from moelab.live.kernel import answer_while_busy

        # Cancel, the layer selector and the tabs answer while a cell blocks (run.wait()): their messages go to
        # a kernel subshell (moelab.live.kernel); `answered_while_busy` says whether this kernel allows it
        self.answered_while_busy = answer_while_busy(self.widgets())
        display(self.box)
