"""moelab.live.compare on real runs: a sweep's table holds its swept values and balance metrics computed from the
stream; the plots are Figures with one line / panel per run."""
import numpy as np
import pytest
from matplotlib.figure import Figure

from moelab.live import compare as compare_mod
from moelab.live.compare import compare
from moelab.run import Run
from moelab.run.session import Session
from moelab.contract.stream import read_events

FAST = {"train": {"steps": 4, "seq_len": 16, "warmup_steps": 1}, "model": {"moe": {"aux_loss_coeff": 0.0}}}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp") / "sweep"
    grid = {"model.moe.capacity_factor": [0.0, 0.5], "model.moe.bias_update_rate": [0.0, 0.01]}
    return Session("tiny", **FAST).sweep(grid, executor="inline", folder=root)


def _demand(run):
    return np.asarray([e["routing"]["routed_per_expert"] for e in read_events(run.folder / "metrics.jsonl")
                       if e["event"] == "step"])


def test_sweep_table_has_swept_values_and_metrics_from_the_stream(sweep):
    cmp = sweep.compare()
    table = cmp.table
    assert list(table.index) == [r.name for r in sweep]
    assert list(table["model.moe.capacity_factor"]) == [0.0, 0.0, 0.5, 0.5]
    assert list(table["model.moe.bias_update_rate"]) == [0.0, 0.01, 0.0, 0.01]
    for col in compare_mod.COLUMNS[1:]:
        assert col in table.columns
    for run, (_, row) in zip(sweep, table.iterrows()):
        load = _demand(run)  # [steps, layers, experts]
        mean = load.mean(-1)
        assert row["max_over_mean"] == pytest.approx((load.max(-1) / mean).mean())
        assert row["cv"] == pytest.approx((load.std(-1) / mean).mean())
        assert row["final_cv"] == pytest.approx((load[-1].std(-1) / mean[-1]).mean())  # last 10% of 4 = 1 step
        assert row["final_loss"] == pytest.approx(run.summary["final_loss"])
        assert row["status"] == "COMPLETED" and row["steps"] == 4
    # capacity 0.5 drops (a quarter of the assignments at least); no capacity drops nothing
    assert list(table["dropped_pct"] > 0) == [False, False, True, True]
    assert table["dropped_pct"].iloc[2] >= 50.0 - 1e-9


def test_plots_draw_one_line_or_panel_per_run(sweep):
    cmp = compare(sweep.folder)  # a sweep folder works as well as the Sweep
    assert len(cmp.runs) == 4
    losses = cmp.plot_losses()
    assert isinstance(losses, Figure) and len(losses.axes[0].lines) == 4
    balance = cmp.plot_balance()
    assert [len(ax.lines) for ax in balance.axes] == [5, 4]  # max/mean has the dashed 1.0 line
    heat = cmp.plot_heatmaps()
    images = [ax.images[0] for ax in heat.axes if ax.images]
    assert len(images) == 4 and {im.get_array().shape for im in images} == {(3, 16)}
    assert len({id(im.norm) for im in images}) == 1  # one colour scale for all panels
    # the heatmap is each expert's summed load over the layer's mean
    load = _demand(sweep[1]).sum(0)
    np.testing.assert_allclose(images[1].get_array(), load / load.mean(-1, keepdims=True))
    assert isinstance(cmp.figure(), Figure)


def test_runs_without_a_sweep_compare_on_the_config_values_that_differ(sweep, tmp_path):
    runs = [Run.load(sweep[0].folder), str(sweep[3].folder)]
    cmp = compare(runs)
    assert [k for k in cmp.table.columns if k.startswith("model.")] == \
        ["model.moe.bias_update_rate", "model.moe.capacity_factor"]
    html = cmp._repr_html_()
    assert "<table" in html and html.count("data:image/png;base64,") == 3
    assert "Comparison of 2 runs" in repr(cmp)
    with pytest.raises(ValueError, match="no runs"):
        compare([])


def test_command_line_writes_the_figure(sweep, tmp_path, capsys):
    out = tmp_path / "fig.png"
    assert compare_mod.main([str(sweep.folder), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "final_cv" in capsys.readouterr().out
