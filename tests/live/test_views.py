"""The text and widget views, driven by the monitor thread over live-written streams (no kernel needed:
ipywidgets keep their state without a front end)."""
import io
import threading
import time

import pytest

from moelab.live import dashboard
from moelab.live.state import DashState
from moelab.live.text import TextView
from moelab.live.widget import WidgetView
from moelab.run import Run

PNG = b"\x89PNG\r\n\x1a\n"


def png(image) -> bool:
    return bytes(image.value).startswith(PNG)


class Tty(io.StringIO):
    def isatty(self):
        return True


def fold(events) -> DashState:
    st = DashState(name="synthetic")
    for e in events:
        st.apply(e)
    return st


def write_slowly(stream, chunks, pause=0.05):
    """A stand-in writer process: appends raw chunks (possibly half lines) with pauses."""
    def go():
        for c in chunks:
            with open(stream.path, "a") as f:
                f.write(c)
            time.sleep(pause)
    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th


def lines(stream, *events):
    import json
    return [json.dumps(e) + "\n" for e in events]


# ---------------------------------------------------------------------- text
def test_text_view_prints_notes_once_and_one_final_line(stream):
    out = io.StringIO()
    view = TextView(out, every_s=3600)
    st = fold([stream.start(total=2), stream.step(1)])
    view.update([st])
    st.apply(stream.event("warning", step=1, kind="overloaded", message="expert 2 got 3x its share"))
    view.update([st])
    view.update([st])
    st.apply(stream.step(2))
    st.apply(stream.event("end", step=2, status="COMPLETED"))
    view.update([st], final=True)
    view.update([st], final=True)
    text = out.getvalue().splitlines()
    assert text.count("synthetic: warning at step 1: overloaded: expert 2 got 3x its share") == 1
    assert text[0].startswith("synthetic  RUNNING  step 1/2 (50%)")
    finals = [t for t in text if "COMPLETED  step 2/2" in t]
    assert len(finals) == 1 and text[-1] == finals[0]


def test_text_view_on_a_terminal_rewrites_one_line(stream):
    out = Tty()
    view = TextView(out)
    st = fold([stream.start(total=2), stream.step(1)])
    view.update([st])
    st.apply(stream.step(2))
    st.apply(stream.event("end", step=2, status="COMPLETED"))
    view.update([st], final=True)
    text = out.getvalue()
    assert text.startswith("\rsynthetic  RUNNING  step 1/2") and text.endswith("\n") and text.count("\n") == 1
    assert "\rsynthetic  COMPLETED  step 2/2 (100%)" in text


def test_dashboard_outside_a_notebook_follows_a_live_stream_with_half_and_corrupt_lines(stream):
    start, s1, s2, s3 = lines(stream, stream.start(total=3), stream.step(1), stream.step(2), stream.step(3))
    end, = lines(stream, stream.event("end", step=3, status="COMPLETED"))
    writer = write_slowly(stream, [start, s1, s2[:25], s2[25:], "{not json\n",
                                   *lines(stream, stream.event("warning", step=2, kind="dead_expert",
                                                               message="layer 1 expert 3")), s3, end])
    out = io.StringIO()
    dash = dashboard(Run(stream.folder), period=0.02, stream=out)
    assert dash.wait(timeout=30) is True
    writer.join()
    st = dash.state
    assert st.steps == [1, 2, 3] and st.status == "COMPLETED" and len(st.corrupt) == 1
    text = out.getvalue()
    assert "skipped a corrupt metrics line" in text and "warning at step 2: dead_expert" in text
    assert text.splitlines()[-1].startswith("run  COMPLETED  step 3/3 (100%)")


def test_dashboard_of_a_failed_run_shows_the_error(stream):
    stream.write(stream.start(total=5), stream.step(1),
                 stream.event("error", step=2, rank=0, message="RuntimeError: CUDA error: out of memory",
                              traceback="Traceback (most recent call last): ..."))
    out = io.StringIO()
    dash = dashboard(Run(stream.folder), period=0.02, stream=out)
    assert dash.wait(timeout=30) is True
    assert dash.state.status == "FAILED"
    assert "error on rank 0 at step 2: RuntimeError: CUDA error: out of memory" in out.getvalue()
    assert "FAILED" in repr(dash) and "out of memory" in repr(dash)


def test_dashboard_follows_the_real_trainer_live(tmp_path):
    """The trainer writes in a thread while the dashboard polls: every step arrives, in order."""
    from moelab.config import load_config
    from moelab.train.trainer import Trainer

    folder = tmp_path / "live"
    folder.mkdir()
    trainer = threading.Thread(target=Trainer(load_config("tiny", ["train.steps=4"]), folder).run, daemon=True)
    out = io.StringIO()
    dash = dashboard(Run(folder), period=0.05, stream=out)
    trainer.start()
    assert dash.wait(timeout=120) is True
    assert dash.state.steps == [1, 2, 3, 4] and dash.state.status == "COMPLETED"
    assert "COMPLETED  step 4/4" in out.getvalue().splitlines()[-1]


def test_a_stream_rewritten_by_a_resume_is_read_again_from_its_start(stream):
    """A resume rewrites metrics.jsonl once (temp file + rename, without the steps it redoes): the monitor
    notices the new file and folds it from the start instead of reading on at the old offset."""
    import os

    from moelab.live.monitor import Target

    stream.write(stream.start(total=6), *(stream.step(s) for s in range(1, 6)))
    target = Target(stream.folder)
    target.poll()
    assert target.state.steps == [1, 2, 3, 4, 5]
    tmp = stream.folder / "metrics.jsonl.tmp"
    tmp.write_text("".join(lines(stream, stream.start(total=6), *(stream.step(s) for s in range(1, 4)),
                                 stream.event("end", step=5, status="PREEMPTED"))))
    os.replace(tmp, stream.path)
    stream.write(stream.start(total=6), *(stream.step(s, loss=1.0) for s in range(4, 7)),
                 stream.event("end", step=6, status="COMPLETED"))
    target.poll()
    st = target.state
    assert st.steps == [1, 2, 3, 4, 5, 6] and st.loss[3:] == [1.0, 1.0, 1.0] and not st.corrupt
    assert st.status == "COMPLETED"


# ---------------------------------------------------------------------- widgets
def test_widget_view_fills_progress_stats_and_charts(stream):
    st = fold([stream.start(total=10), *(stream.step(s) for s in range(1, 5)),
               stream.event("warning", step=4, kind="dead_expert", message="layer 1 expert 3 got no tokens")])
    view = WidgetView(["synthetic"], [None], chart_every_s=3600)
    view.update([st])
    p = view.panels[0]
    assert (p.progress.value, p.progress.max, p.progress.bar_style) == (4, 10, "info")
    assert "ETA 0:06" in p.progress_text.value
    for label in ("loss", "tokens/s/rank", "TFLOPs/rank", "MFU", "peak memory per rank", "r0 0.50 · r1 0.70 GB"):
        assert label in p.stats.value
    assert png(p.train_chart) and png(p.routing_chart)
    assert p.layer.options == (("MoE layer 0", 0), ("MoE layer 1", 1)) and p.layer.value == 0  # the skewed layer
    assert "max/mean 2.00" in p.balance.value and "dead 1/4" in p.balance.value
    assert "layer 1 expert 3 got no tokens" in p.messages.value and p.cancel_button.disabled  # nothing to cancel

    before = p.routing_chart.value
    p.layer.value = 1  # the selector redraws at once (a callback on the kernel's main thread)
    assert p.routing_chart.value != before and "max/mean 1.00" in p.balance.value

    chart = p.train_chart.value
    st.apply(stream.step(5))
    view.update([st])  # within chart_every_s: numbers move, the chart waits
    assert p.progress.value == 5 and p.train_chart.value == chart
    st.apply(stream.event("end", step=5, status="COMPLETED"))
    view.update([st], final=True)
    assert p.train_chart.value != chart and p.progress.bar_style == "success"
    assert p.cancel_button.description == "Done"


def test_widget_view_of_a_failed_run_and_its_cancel_button(stream):
    cancelled = []
    st = fold([stream.start(total=10), stream.step(1)])
    view = WidgetView(["synthetic"], [lambda: cancelled.append(True)])
    view.update([st])
    p = view.panels[0]
    assert not p.cancel_button.disabled
    p.cancel_button.click()
    assert cancelled == [True] and p.cancel_button.disabled
    st.apply(stream.event("error", step=2, rank=3, message="ValueError: bad batch", traceback="Traceback: line 1"))
    st.set_run("FAILED")
    view.update([st], final=True)
    assert p.progress.bar_style == "danger" and "FAILED" in p.header.value
    assert "rank 3, step 2: ValueError: bad batch" in p.messages.value and "<details>" in p.messages.value


def test_a_failing_cancel_is_shown_not_raised(stream):
    stream.write(stream.start(total=10))
    run = Run(stream.folder)  # an external run: only its own foreground process can stop it
    view = WidgetView(["x"], [run.cancel])
    view.panels[0].cancel_button.click()
    assert "cancel failed" in view.panels[0].messages.value


def test_sweep_view_compares_runs_and_draws_only_the_visible_tab(stream, tmp_path):
    a = fold([stream.start(total=4), *(stream.step(s) for s in range(1, 5)),
              stream.event("end", step=4, status="COMPLETED")])
    b = fold([stream.start(total=4), stream.step(1, counts_ME=[[5.0] * 4, [5.0] * 4])])
    a.name, b.name = "aux=0", "aux=0.01"
    view = WidgetView([a.name, b.name], [None, None], cancel_all=lambda: None)
    view.update([a, b])
    assert view.tabs.titles == ("aux=0", "aux=0.01")
    table = view.table.value
    assert table.count("<tr>") == 3 and "aux=0.01" in table and "COMPLETED" in table and "RUNNING" in table
    assert "1 finished" in view.header.value and not view.cancel_all.disabled
    assert png(view.panels[0].train_chart) and not bytes(view.panels[1].train_chart.value)
    view.tabs.selected_index = 1
    assert png(view.panels[1].train_chart)
    view.resync()  # no kernel: re-sending is a no-op, but must not fail


@pytest.mark.parametrize("status,error", [("CANCELLED", ""), ("TIMEOUT", "the job ended as TIMEOUT\nslurmstepd: ..."),
                                          ("FAILED", "")])
def test_a_run_that_ended_without_writing_shows_its_status_and_error(status, error):
    st = DashState(name="job")
    st.set_run(status, error)
    view = WidgetView(["job"], [None])
    view.update([st], final=True)
    p = view.panels[0]
    assert status in p.header.value and p.progress.bar_style == "danger"
    if status == "CANCELLED":  # nothing went wrong: the badge is enough
        assert p.messages.value == ""
    else:
        assert f"<b>{status}</b>: " in p.messages.value
        assert ("<details>" in p.messages.value) == bool(error)  # the stderr tail folded under the first line


def test_picking_layers_while_the_monitor_thread_folds_events(stream):
    """The layer callback (main thread) and the monitor thread share one lock: no chart is drawn from a state
    that is half folded, and neither side fails."""
    from moelab.live.monitor import Monitor, Target

    steps = 40
    events = [stream.start(total=steps), *(stream.step(s) for s in range(1, steps + 1)),
              stream.event("end", step=steps, status="COMPLETED")]
    writer = write_slowly(stream, lines(stream, *events), pause=0.01)
    view = WidgetView(["x"], [None], chart_every_s=0.0)
    panel = view.panels[0]
    monitor = Monitor([Target(stream.folder)], view, period=0.005).start()
    flips = 0
    while not monitor._finished.wait(0.01):
        if panel.layer.options:
            panel.layer.value = 1 - panel.layer.value
            flips += 1
    writer.join()
    assert monitor.wait(timeout=30) is True and flips > 0
    assert (panel.progress.value, panel.progress.bar_style) == (steps, "success")
    assert "last 20 steps (mean over steps): max/mean" in panel.balance.value and png(panel.routing_chart)


@pytest.mark.slow
def test_the_cancel_button_stops_a_real_local_run(tmp_path, monkeypatch):
    """Session -> local executor -> widget dashboard; Cancel (a click, as the front end sends it) ends the job and
    the dashboard shows CANCELLED."""
    from moelab import Session

    monkeypatch.setenv("MOELAB_UI", "widget")  # the widget view, without a kernel to display it in
    run = Session("tiny", train={"steps": 100000, "device": "cpu"}).submit("local", folder=tmp_path / "long")
    dash = run.dashboard()
    panel = dash.widget_view.panels[0]
    deadline = time.monotonic() + 120
    while dash.state.step < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dash.state.step >= 2 and not panel.cancel_button.disabled
    panel.cancel_button.click()
    assert dash.wait(timeout=120) is True
    assert run.status == dash.state.status == "CANCELLED"
    assert panel.progress.bar_style == "danger" and panel.cancel_button.description == "Cancelled"
    assert "CANCELLED" in panel.header.value and dash.state.step < 100000
