"""The architecture move changed no number: the tiny preset's losses, gradient norms, aux losses and routing
counts on 1 process and on 2 gloo processes with EP=2 are bit-identical to the figures the code before the move
computed (golden_losses.json, written by golden_losses.py from main at 932bbce)."""
import importlib.util
import json
from pathlib import Path

import pytest

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("golden_losses", HERE / "golden_losses.py")
golden = importlib.util.module_from_spec(spec)
spec.loader.exec_module(golden)


@pytest.mark.parametrize("layout", ["1proc", "ep2"])
def test_figures_bit_identical_to_before_the_move(layout, tmp_path):
    expected = json.loads(golden.FIXTURE.read_text())
    assert expected["overrides"] == golden.OVERRIDES
    figures = golden.run_layout(layout, tmp_path / layout)
    assert len(figures["loss"]) == 4
    for key, values in expected["layouts"][layout].items():
        assert figures[key] == values, key  # exact equality: not approx
