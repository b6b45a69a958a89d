"""What the dashboard says now versus over the run: one balance definition shared with compare() and
summary.json, smoothed throughput with the run's mean, MFU on CPU, health now plus its history, the
load-over-steps heatmap, placeholders before the first data, sweep tabs and the static snapshot."""
import pytest

from moelab.live.compare import compare
from moelab.live.plots import routing_figure, training_figure
from moelab.live.state import ROUTING_WINDOW, DashState, StepBuckets, load_state
from moelab.live.widget import WidgetView, sweep_labels
from moelab.run import Run
from moelab.contract.summary import balance, step_balance


def fold(events) -> DashState:
    st = DashState(name="synthetic")
    for e in events:
        st.apply(e)
    return st


def test_one_balance_definition_in_dashboard_summary_and_compare(tiny_folder):
    """The figures issue 20 found disagreeing (1.48 in the dashboard, 1.631 in compare for the same run)."""
    st = load_state(tiny_folder)
    run = Run.load(tiny_folder)
    row = compare([run]).rows[0]
    dash = st.balance_summary()
    summary = run.summary["balance"]
    assert dash["max_over_mean"] == pytest.approx(row["max_over_mean"]) == pytest.approx(summary["max_over_mean"])
    assert dash["cv"] == pytest.approx(row["cv"]) == pytest.approx(summary["cv"])
    # the definition: per step the mean over MoE layers of balance(), then the mean over steps
    demand_SLE = [e["routing"]["routed_per_expert"] for e in run.events if e["event"] == "step"]
    per_step = [sum(balance(c)["max_over_mean"] for c in s) / len(s) for s in demand_SLE]
    assert dash["max_over_mean"] == pytest.approx(sum(per_step) / len(per_step))
    # and it is not what the sum over the run gives (the older dashboard figure)
    totals_LE = [[sum(c) for c in zip(*(s[i] for s in demand_SLE))] for i in range(len(demand_SLE[0]))]
    assert step_balance(totals_LE)["max_over_mean"] < dash["max_over_mean"]
    assert [b["max_over_mean"] for b in run.summary["routing_balance"]] == pytest.approx(
        [st.layer_balance(i, window=False)["max_over_mean"] for i in range(st.num_layers)])


def test_throughput_is_shown_recent_and_as_the_run_mean(stream):
    st = fold([stream.start(total=40), *(stream.step(s) for s in range(1, 31))])  # 1000 + step tokens/s/GPU
    t = st.throughput()
    assert t["last"] == 1030.0
    assert t["recent"] == pytest.approx(sum(range(1011, 1031)) / ROUTING_WINDOW)
    assert t["run"] == pytest.approx(sum(range(1003, 1031)) / 28)  # the first two steps left out, as summary.json
    view = WidgetView(["x"], [None], chart_every_s=3600)
    view.update([st])
    stats = view.panels[0].stats.value
    assert "1,020" in stats and "run mean 1,016" in stats and "last step 1,030" in stats


def test_mfu_on_cpu_says_why_it_is_missing(stream):
    start = {**stream.start(total=5), "env": {"device": "cpu"}}
    st = fold([start, stream.step(1)])
    assert st.last.mfu is None and st.mfu_text() == "n/a on CPU: no peak FLOP/s"
    st.device = "cuda"
    assert st.mfu_text() == "n/a: unknown peak FLOP/s"
    st.last.mfu = 0.412
    assert st.mfu_text() == "41.2%"


def test_health_now_leads_and_an_early_warning_is_history(stream):
    sick = {"dead_experts": [[0, 3]], "overloaded": [[0, 2, 0.5]]}
    early = [stream.start(total=30), {**stream.step(1), "health": sick}, {**stream.step(2), "health": sick},
             stream.event("warning", step=2, kind="dead_expert", layer=0, expert=3, message="layer 0 expert 3 dead")]
    st = fold(early)
    assert st.health_now() == "1 dead, 1 overloaded"
    view = WidgetView(["x"], [None], chart_every_s=3600)
    view.update([st])
    assert "experts now: 1 dead, 1 overloaded" in view.panels[0].messages.value
    for s in range(3, 25):
        st.apply({**stream.step(s), "health": {"dead_experts": [], "overloaded": []}})
    view.update([st])
    msg = view.panels[0].messages.value
    assert st.health_now() == "healthy" and "experts healthy now</b> (at step 24)" in msg
    assert "<details><summary>1 health warning(s) so far, last at step 2" in msg  # folded history
    assert st.health_I[0] == (1, 1) and st.health_I[-1] == (0, 0)
    fig = training_figure(st)
    balance_ax = next(ax for ax in fig.axes if ax.get_title(loc="left").startswith("load balance"))
    marks = [line for line in balance_ax.lines if line.get_label() == "dead expert warning"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [2]  # the warning marked on the chart


def test_step_buckets_keep_the_load_over_steps_bounded():
    b = StepBuckets(cap=4)
    for step in range(1, 10):
        b.add(step, [[1.0, 3.0], [2.0, 2.0]])
    spans, load_BE = b.layer(0)
    assert spans == [(1, 4), (5, 8), (9, 9)] and load_BE.tolist() == [[4.0, 12.0], [4.0, 12.0], [1.0, 3.0]]
    b.truncate(6)  # a requeued run redoes steps 6..
    assert b.layer(1)[0] == [(1, 4)]


def test_the_routing_chart_has_the_load_over_steps_heatmap_of_the_chosen_layer(stream):
    st = fold([stream.start(total=10), *(stream.step(s) for s in range(1, 6))])
    fig = routing_figure(st, layer=1)
    heat = next(ax for ax in fig.axes if ax.get_title(loc="left") == "MoE layer 1: load / mean over steps")
    mesh = heat.collections[0]
    assert mesh.get_array().shape == (4, 5)  # experts x steps
    assert mesh.get_array().tolist() == [[1.0] * 5] * 4  # layer 1 is even in every step


def test_placeholders_before_the_first_data(stream):
    st = fold([stream.start(total=10)])
    view = WidgetView(["x"], [None], chart_every_s=0)
    view.update([st])
    p = view.panels[0]
    assert p.train_chart.layout.display == "none" and p.routing_chart.layout.display == "none"
    assert p.layer.layout.display == "none" and p.placeholder.layout.display is None
    pending = DashState(name="queued")
    pending.set_run("PENDING")
    view.update([pending])
    assert "waiting for the job to start (PENDING)" in p.progress_text.value and "?" not in p.progress_text.value
    st.apply(stream.step(1))
    view.update([st])
    assert p.train_chart.layout.display is None and p.routing_chart.layout.display is None
    assert p.layer.layout.display is None and p.placeholder.layout.display == "none"


def test_sweep_tabs_show_the_swept_values():
    titles, varied = sweep_labels(["00-aux_loss_coeff=0,bias_update_rate=0", "01-aux_loss_coeff=0.01,"
                                   "bias_update_rate=0.002"])
    assert titles == ["0, 0", "0.01, 0.002"] and varied == "aux_loss_coeff, bias_update_rate"
    assert sweep_labels(["a", "b"]) == (["a", "b"], "")


def test_the_snapshot_is_static_html_of_the_final_dashboard(stream):
    st = fold([stream.start(total=3), *(stream.step(s) for s in range(1, 4)),
               stream.event("end", step=3, status="COMPLETED")])
    view = WidgetView(["x"], [None])
    view.update([st], final=True)
    snap = view.snapshot_html()
    assert "class='moelab-snapshot'" in snap and snap.count("data:image/png;base64,") == 2
    assert "COMPLETED" in snap and "tokens/s/rank" in snap and "3</b> / 3 steps" in snap
    sweep = WidgetView(["00-a=1", "01-a=2"], [None, None])
    sweep.update([st, st], final=True)
    snap = sweep.snapshot_html()
    assert snap.count("<tr>") == 3 and snap.count("data:image/png;base64,") == 1  # table and the overlaid curves
