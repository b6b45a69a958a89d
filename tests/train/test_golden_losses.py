"""The architecture move changed no number: the tiny preset's losses, gradient norms, aux losses and routing
counts on 1 process and on 2 gloo processes with EP=2 are bit-identical to the figures the code before the move
computed (golden_losses.json, written by golden_losses.py from main at 932bbce), with backend.loss=full; the
default fused loss (backend.loss=chunked) reproduces its own record (golden_losses_chunked.json) bit for bit."""
import importlib.util
import json
from pathlib import Path

import pytest

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("golden_losses", HERE / "golden_losses.py")
golden = importlib.util.module_from_spec(spec)
spec.loader.exec_module(golden)


@pytest.mark.parametrize("loss", ["full", "chunked"])
@pytest.mark.parametrize("layout", ["1proc", "ep2"])
def test_figures_bit_identical_to_before_the_move(layout, loss, tmp_path):
    expected = json.loads(golden.LOSSES[loss][0].read_text())
    assert expected["overrides"] == golden.OVERRIDES
    figures = golden.run_layout(layout, tmp_path / layout, loss)
    assert len(figures["loss"]) == 4
    for key, values in expected["layouts"][layout].items():
        assert figures[key] == values, key  # exact equality: not approx
