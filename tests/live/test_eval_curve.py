"""The held-out loss (`eval` events) in the dashboard state and beside the training loss in the plots."""
from moelab.live import plot_throughput
from moelab.live.state import DashState


def _state(stream, *events):
    st = DashState()
    for e in (stream.start(total=6),) + events:
        st.apply(e)
    return st


def test_eval_events_become_a_curve_that_a_repeated_step_rewinds(stream):
    ev = lambda step, loss: stream.event("eval", step=step, loss=loss, perplexity=2.718 ** loss)
    st = _state(stream, stream.step(1), stream.step(2), ev(2, 4.0), stream.step(3), stream.step(4), ev(4, 3.5))
    assert st.eval_steps == [2, 4] and st.eval_loss == [4.0, 3.5]
    st.apply(stream.step(3))  # a requeued run repeats step 3: the eval after step 4 is gone, the one at 2 stays
    assert st.eval_steps == [2] and st.eval_loss == [4.0]
    st.apply(stream.step(4))
    st.apply(ev(4, 3.4))
    assert st.eval_steps == [2, 4] and st.eval_loss == [4.0, 3.4]


def test_the_loss_panel_draws_eval_beside_train(stream):
    st = _state(stream, stream.step(1), stream.step(2), stream.event("eval", step=2, loss=4.2, perplexity=66.7))
    ax = plot_throughput(st).axes[0]
    assert [line.get_label() for line in ax.lines] == ["train", "eval"]
    assert list(ax.lines[1].get_xdata()) == [2] and list(ax.lines[1].get_ydata()) == [4.2]
    plain = plot_throughput(_state(stream, stream.step(1))).axes[0]
    assert len(plain.lines) == 1 and plain.get_legend() is None  # no eval: the panel is as before
