"""The dashboard's controls: change a field of the running run, ask for a checkpoint, fork from the newest
checkpoint, from the widget (ipywidgets; the callbacks run on the kernel's main thread, or a subshell while
another cell blocks in `run.wait()`, as Cancel does).

Every action goes through the Run (Run.set, Run.fork), so the widget refuses exactly what a notebook cell would,
with the same message, and writes nothing then.

    bar = ControlsBar(run)        # RunPanel shows bar.box under its header
    bar.field.value = "model.moe.bias_update_rate"; bar.value.value = "0.01"; bar.apply.click()
"""
from __future__ import annotations

import html

import ipywidgets as w

from moelab.config import parse_override
from moelab.config.live import LIVE_FIELDS


class ControlsBar:
    """Field + value + Apply, Checkpoint now, and Fork here (name) for one run; what happened is shown in
    `note`.

        bar = ControlsBar(run); bar.field.value = "train.lr"; bar.value.value = "1e-3"; bar.apply.click()
    """

    def __init__(self, run):
        self.run = run
        small = dict(layout=w.Layout(width="auto"))
        self.field = w.Dropdown(options=list(LIVE_FIELDS), value="model.moe.bias_update_rate",
                                description="change", style={"description_width": "initial"},
                                layout=w.Layout(width="310px"))
        self.value = w.Text(placeholder="value", layout=w.Layout(width="90px"))
        self.apply = w.Button(description="Apply", icon="check", tooltip="apply at the next step boundary", **small)
        self.checkpoint = w.Button(description="Checkpoint now", icon="save", **small)
        self.fork_name = w.Text(placeholder="fork name", layout=w.Layout(width="110px"))
        self.fork = w.Button(description="Fork here", icon="code-branch",
                             tooltip="a new run from the newest checkpoint, with the change above if a value is "
                                     "given", **small)
        self.note = w.HTML()
        self.history = w.HTML()  # the changes applied so far, as the stream's `control` events record them
        self._shown = -1
        self.apply.add_class("moelab-apply")  # found by the browser test
        self.apply.on_click(self._on_apply)
        self.checkpoint.on_click(lambda _b: self._act(lambda: self.run.set(checkpoint=True),
                                                      "checkpoint requested at the next step boundary"))
        self.fork.on_click(self._on_fork)
        self.field.observe(lambda _c: setattr(self.field, "tooltip", LIVE_FIELDS.get(self.field.value, "")),
                           names="value")
        self.box = w.VBox([w.HBox([self.field, self.value, self.apply, self.checkpoint, self.fork_name, self.fork],
                                  layout=w.Layout(align_items="center", flex_flow="row wrap")),
                           self.note, self.history])

    def widgets(self) -> list:
        """Every widget of the bar (the dashboard routes their messages to a kernel subshell: moelab.live.kernel)."""
        return [self.field, self.value, self.apply, self.checkpoint, self.fork_name, self.fork, self.note,
                self.history]

    def changes(self) -> dict:
        """{field: value} from the two inputs (the value read as YAML, as `--set` reads it); {} without a value."""
        text = self.value.value.strip()
        return dict([parse_override(f"{self.field.value}={text}")]) if text else {}

    def _act(self, action, done: str) -> None:
        try:
            action()
        except Exception as e:  # shown, not raised: a callback's exception would only reach the kernel log
            self.note.value = f"<span style='color:#d62728;font-size:12px'>{html.escape(str(e))}</span>"
            return
        self.note.value = f"<span style='color:#2ca02c;font-size:12px'>{html.escape(done)}</span>"

    def _on_apply(self, _button) -> None:
        changes = self.changes()
        if not changes:
            self.note.value = "<span style='color:#d62728;font-size:12px'>give a value to apply</span>"
            return
        self._act(lambda: self.run.set(changes, origin="dashboard"),
                  f"requested {self.field.value}={changes[self.field.value]!r}: applied at the next step boundary")

    def _on_fork(self, _button) -> None:
        executor = None if self.run.in_background else "local"  # a fork never blocks the kernel
        made = []
        self._act(lambda: made.append(self.run.fork(name=self.fork_name.value.strip() or None, executor=executor,
                                                    **self.changes())), "fork started")
        if made:
            child = made[0]
            self.note.value = (f"<span style='color:#2ca02c;font-size:12px'>fork {html.escape(child.name)} from step "
                               f"{child.parent['step']}: Run.load({html.escape(repr(str(child.folder)))})"
                               f".dashboard()</span>")

    def show(self, controls: list) -> None:
        """The applied changes (`control` events), one line each: after step N: field old -> new (who)."""
        if len(controls) == self._shown:
            return
        self._shown = len(controls)
        lines = [f"after step {c.step}: {html.escape(str(c.field))} {c.old!r} &rarr; "
                 f"{c.new!r} <span style='color:#777'>({html.escape(str(c.who or ''))})</span>"
                 for c in controls[-5:]]
        self.history.value = (f"<div style='color:#9467bd;font-size:11px'>{'<br>'.join(lines)}</div>"
                              if lines else "")

    def finished(self, status: str) -> None:
        """The run ended: nothing left to change (a fork still can be made)."""
        self.apply.disabled = self.checkpoint.disabled = True
