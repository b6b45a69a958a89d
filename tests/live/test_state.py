"""DashState: folding the metrics stream (hand-written events with exact numbers, and a real run)."""
import pytest

from moelab.live.state import ROUTING_WINDOW, DashState, load_state
from moelab.contract.stream import JsonlTail
from moelab.contract.summary import balance


def fold(events) -> DashState:
    st = DashState()
    for e in events:
        st.apply(e)
    return st


def test_a_completed_run_is_folded_into_progress_stats_memory_and_routing(stream):
    events = [stream.start(total=5), *(stream.step(s, mem_R=(0.5 + s / 10, 0.4)) for s in range(1, 6)),
              stream.event("warning", step=3, kind="dead_expert", message="layer 1 expert 3 got no tokens"),
              stream.event("end", step=5, status="COMPLETED", summary={"final_loss": 4.5})]
    st = fold(events)
    assert (st.name, st.step, st.total_steps, st.status, st.done, st.failed) == \
        ("synthetic", 5, 5, "COMPLETED", True, False)
    assert st.steps == [1, 2, 3, 4, 5] and st.loss == pytest.approx([4.9, 4.8, 4.7, 4.6, 4.5])
    assert st.tokens_per_s_per_gpu == [1001.0, 1002.0, 1003.0, 1004.0, 1005.0]
    assert st.memory_key == "rss_gb"  # the allocator reported 0: a CPU run
    assert st.memory_peak_R == pytest.approx([1.0, 0.4]) and st.memory_max == pytest.approx([0.6, 0.7, 0.8, 0.9, 1.0])
    assert st.routing_total_ME == [[50.0, 100.0, 150.0, 0.0], [75.0] * 4]
    assert st.layer_balance(0) == balance([50.0, 100.0, 150.0, 0.0])
    assert st.layer_balance(0)["dead"] == 1 and st.layer_balance(1)["cv"] == 0.0
    assert st.worst_layer() == 0 and st.layer_name(0) == "MoE layer 0"
    assert st.balance_summary()["dead"] == 0  # dead at the last step comes from its health, absent here
    assert [w.kind for w in st.warnings] == ["dead_expert"] and st.summary == {"final_loss": 4.5}
    assert st.eta_s() is None  # done
    line = st.status_line()
    assert "synthetic  COMPLETED  step 5/5 (100%)" in line and "loss 4.5" in line and "mem 1.00 GB" in line


def test_eta_comes_from_the_recent_step_rate(stream):
    st = fold([stream.start(total=10), *(stream.step(s) for s in range(1, 5))])  # one step per second
    assert st.status == "RUNNING" and not st.done
    assert st.seconds_per_step() == pytest.approx(1.0)
    assert st.eta_s() == pytest.approx(6.0)
    assert "ETA 0:06" in st.status_line()


def test_the_routing_window_holds_the_last_steps_only(stream):
    st = fold([stream.start(total=100)] + [stream.step(s, counts_ME=[[1.0, 0.0]]) for s in range(1, 31)]
              + [stream.step(31, counts_ME=[[0.0, 100.0]])])
    assert len(st.routing_window) == ROUTING_WINDOW
    assert st.routing_ME(window=True) == [[ROUTING_WINDOW - 1.0, 100.0]]
    assert st.routing_ME(window=False) == [[30.0, 100.0]]


def test_a_requeued_run_rewinds_the_history_to_the_repeated_step(stream):
    st = fold([stream.start(total=10), *(stream.step(s) for s in range(1, 6)),
               stream.event("end", step=5, status="PREEMPTED"), stream.start(total=10),
               stream.step(4, loss=9.0), stream.step(5, loss=8.0)])
    assert st.steps == [1, 2, 3, 4, 5] and st.loss[-2:] == [9.0, 8.0]
    assert st.status == "RUNNING" and not st.done


def test_an_error_event_fails_the_run_and_keeps_the_message(stream):
    st = fold([stream.start(total=10), stream.step(1),
               stream.event("error", step=2, rank=1, message="RuntimeError: boom", traceback="Traceback ...")])
    assert st.status == "FAILED" and st.done and st.failed
    assert st.error_text() == "rank 1, step 2: RuntimeError: boom"
    assert "error: rank 1, step 2: RuntimeError: boom" in st.status_line()


def test_the_run_objects_status_decides_when_there_is_one(stream):
    st = fold([stream.start(total=10), stream.step(1),
               stream.event("error", step=2, rank=1, message="boom")])
    st.set_run("RUNNING")  # other ranks are still going down: not done yet, but shown as failed
    assert st.status == "FAILED" and not st.done
    st.set_run("FAILED", "rank 1 at step 2: boom")
    assert st.done and st.failed
    cancelled = DashState()
    cancelled.set_run("PENDING")
    assert cancelled.status == "PENDING" and not cancelled.done
    cancelled.set_run("CANCELLED", "")
    assert cancelled.status == "CANCELLED" and cancelled.done and cancelled.failed


def test_half_written_and_corrupt_lines_through_the_tail(stream):
    """The writer may be mid-line: nothing is lost or invented; a corrupt complete line is reported, skipped."""
    stream.write(stream.start(total=3), stream.step(1), raw='{"event": "step", "schema": 1, "ti')
    tail, st = JsonlTail(stream.path), DashState()
    for e in tail.poll():
        st.apply(e)
    assert st.step == 1
    with open(stream.path, "a") as f:
        f.write('me": 1002.0, "step": 2, "loss": 4.0}\nthis is not json\n')
    stream.write(stream.step(3))
    for e in tail.poll():
        st.apply(e)
    st.set_corrupt(tail.errors)
    assert st.steps == [1, 2, 3] and st.loss[1] == 4.0
    assert len(st.corrupt) == 1 and "metrics.jsonl:4: not valid JSON" in st.corrupt[0]


def test_load_state_reads_a_real_run(tiny_folder):
    st = load_state(tiny_folder)
    assert st.name == tiny_folder.name and st.status == "COMPLETED" and st.step == st.total_steps == 6
    assert len(st.routing_total_ME) == 3 and all(len(c) == 16 for c in st.routing_total_ME)
    assert all(x > 0 for x in st.tokens_per_s_per_gpu) and st.peak_memory_gb() > 0


def test_load_state_names_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="is .* a run folder"):
        load_state(tmp_path)


def test_balance_is_measured_on_the_routers_demand_before_capacity_drops(stream):
    """With a capacity factor the experts compute an even load; the imbalance is in what the router asked for."""
    ev = stream.step(1, counts_ME=[[10.0, 10.0, 10.0, 10.0]])
    ev["routing"]["routed_per_expert"] = [[25.0, 5.0, 10.0, 10.0]]
    ev["routing"]["dropped_tokens"] = [10.0]
    st = fold([stream.start(total=2), ev])
    assert st.routing_total_ME == [[25.0, 5.0, 10.0, 10.0]] and st.layer_balance(0)["max_over_mean"] == 2.0
    assert st.dropped_pct == pytest.approx(20.0)
    older = fold([stream.start(total=2), stream.step(1)])  # a stream from before routed_per_expert
    assert older.routing_total_ME == stream.COUNTS_LE and older.dropped_pct == 0.0


@pytest.mark.parametrize("device,per", [("cpu", "rank"), (None, "rank"), ("cuda:0", "GPU")])
def test_throughput_is_labelled_per_gpu_only_on_gpus(stream, device, per):
    """A CPU rank is no GPU: the status line, the dashboard's cells and the plots say per rank there."""
    from moelab.live.plots import plot_throughput
    from moelab.live.widget import stats_html

    start = stream.start(total=5)
    if device:
        start["env"] = {"device": device, "world_size": 1}
    st = fold([start, *(stream.step(s) for s in range(1, 4))])
    other = "GPU" if per == "rank" else "rank"
    assert f"tok/s/{per}" in st.status_line() and f"tok/s/{other}" not in st.status_line()
    assert f"tokens/s/{per}" in stats_html(st) and f"TFLOPs/{other}" not in stats_html(st)
    titles = [ax.get_title(loc="left") for ax in plot_throughput(st).axes]
    assert f"tokens/s per {per}" in titles and not any(f"per {other}" in t for t in titles)
