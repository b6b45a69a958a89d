"""Static plots return matplotlib Figures; `moelab report FOLDER` writes them as PNG files."""
import pytest
from matplotlib.figure import Figure

from moelab.cli import main
from moelab.config import ConfigError
from moelab.live import load_state, plot_memory, plot_routing, plot_throughput
from moelab.run import Run

PNG = b"\x89PNG\r\n\x1a\n"


def titles(fig) -> list[str]:
    return [ax.get_title(loc="left") for ax in fig.axes]


def test_plots_of_a_run_are_figures_with_the_expected_panels(tiny_folder):
    run = Run.load(tiny_folder)
    fig = run.plot_throughput()
    assert isinstance(fig, Figure) and titles(fig)[:3] == ["loss", "tokens/s per rank", "TFLOPs per rank"]  # a CPU run
    assert len(fig.axes[0].lines[0].get_xdata()) == 6
    fig = run.plot_memory()
    assert isinstance(fig, Figure) and titles(fig) == ["memory over steps (peak RSS GB)",
                                                       "memory per rank (peak RSS GB)"]
    fig = run.plot_routing()  # heatmap + colorbar + the least balanced layer's histogram
    st = load_state(tiny_folder)
    worst = st.worst_layer(window=False)
    assert isinstance(fig, Figure) and titles(fig)[0] == "routing load / mean, whole run"
    assert titles(fig)[1].startswith(f"MoE layer {worst}, whole run:\nmax/mean")
    assert titles(fig)[3] == f"MoE layer {worst}: load / mean over steps"  # the expert x step heatmap
    assert len(fig.axes[1].patches) == 16  # one bar per expert
    assert fig._repr_png_().startswith(PNG)  # shows itself in a notebook without pyplot


def test_plot_routing_of_a_chosen_layer_and_a_wrong_one(tiny_folder):
    fig = plot_routing(tiny_folder, layer=2)
    b = load_state(tiny_folder).layer_balance(2, window=False)
    assert titles(fig)[1].startswith(f"MoE layer 2, whole run:\nmax/mean {b['max_over_mean']:.2f} · cv {b['cv']:.2f}")
    with pytest.raises(ConfigError, match="layer=7 is not an MoE layer index of this run; use 0..2"):
        plot_routing(tiny_folder, layer=7)


def test_plots_of_a_run_without_steps_say_so(stream):
    stream.write(stream.start(total=5))
    for fn in (plot_throughput, plot_memory, plot_routing):
        fig = fn(stream.folder)
        assert isinstance(fig, Figure)
        assert any(t.get_text() in ("waiting for the first step", "no routing yet") for ax in fig.axes
                   for t in ax.texts)


def test_moelab_report_writes_pngs(tiny_folder, tmp_path, capsys):
    assert main(["report", str(tiny_folder), "--out", str(tmp_path / "rep")]) == 0
    written = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[-1] for p in written] == ["throughput.png", "memory.png", "routing.png"]
    for name in ("throughput", "memory", "routing"):
        data = (tmp_path / "rep" / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000


def test_moelab_report_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_plot_routing_titles_fit_inside_the_png(tiny_folder):
    fig = plot_routing(tiny_folder)
    fig.canvas.draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    texts = [ax.title for ax in fig.axes] + [ax._left_title for ax in fig.axes] + [fig._suptitle]
    for t in texts:
        if t is not None and t.get_text():
            ext = t.get_window_extent(renderer)
            assert box.x0 <= ext.x0 and ext.x1 <= box.x1 and ext.y1 <= box.y1, t.get_text()
