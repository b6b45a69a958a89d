"""The dashboard's controls (moelab.live.controls) and control marks (moelab.live.plots.mark_controls): the
widget refuses what Run.set refuses, with its message and without writing; Apply and Checkpoint now append the
request a run's rank 0 reads; `control` events are folded into the state (and dropped when a resumed run goes
back before them) and marked on every chart over steps."""
from __future__ import annotations

import hashlib

import pytest

from moelab.config import load_config, save_config
from moelab.contract.controls import read_controls
from moelab.live import plots
from moelab.live.controls import ControlsBar
from moelab.live.state import DashState
from moelab.run import Run


def _bytes(folder):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def waiting_run(tmp_path):
    """A run folder written but not started yet (no stream): a run whose next boundary is its first."""
    save_config(load_config("tiny"), tmp_path / "config.yaml")
    return Run.load(tmp_path)


def test_the_widget_refuses_as_run_set_does_and_writes_nothing(waiting_run):
    bar = ControlsBar(waiting_run)
    before = _bytes(waiting_run.folder)
    bar.field.value, bar.value.value = "model.moe.capacity_factor", "-1"
    bar.apply.click()
    assert "model.moe.capacity_factor=-1.0: must be &gt;= 0" in bar.note.value
    bar.field.value, bar.value.value = "model.moe.dynamic_capacity", "true"
    bar.apply.click()
    assert "needs model.moe.capacity_factor &gt; 0" in bar.note.value
    assert _bytes(waiting_run.folder) == before


def test_apply_and_checkpoint_now_append_requests(waiting_run):
    bar = ControlsBar(waiting_run)
    bar.field.value, bar.value.value = "model.moe.bias_update_rate", "1e-3"
    bar.apply.click()
    assert "applied at the next step boundary" in bar.note.value
    bar.checkpoint.click()
    requests, _ = read_controls(waiting_run.folder)
    assert [r["changes"] for r in requests] == [{"model.moe.bias_update_rate": 0.001}, {"checkpoint": True}]
    assert all(r["who"].endswith("dashboard") for r in requests[:1])


def _events():
    yield {"event": "start", "total_steps": 6, "config": {"name": "t"}, "time": 1.0}
    for s in range(1, 5):
        yield {"event": "step", "step": s, "loss": 5.0 - s * 0.1, "time": 1.0 + s}
        if s == 2:
            yield {"event": "control", "step": 2, "field": "model.moe.aux_loss_coeff", "old": 0.01, "new": 0.1,
                   "who": "me", "time": 3.5}


def test_control_events_are_marked_on_every_chart_over_steps():
    st = DashState()
    for e in _events():
        st.apply(e)
    assert [c.field for c in st.controls] == ["model.moe.aux_loss_coeff"]
    fig = plots.training_figure(st)
    marked = [ax for ax in fig.axes if any(line.get_color() == "tab:purple" and list(line.get_xdata()) == [2, 2]
                                           for line in ax.lines)]
    assert len(marked) == 7  # all but the memory-per-rank bars
    assert any("aux_loss_coeff=0.1" in t.get_text() for ax in marked for t in ax.texts)
    # a resumed run that goes back to step 2 applies the change again: the old mark goes
    st.apply({"event": "step", "step": 2, "loss": 4.8, "time": 9.0})
    assert st.controls == []
