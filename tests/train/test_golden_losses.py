"""The architecture move changed no number: the tiny preset's losses, gradient norms, aux losses and routing
counts on 1 process and on 2 gloo processes with EP=2 are identical (the reported scalars to a few float32 ulps,
see REDUCED) to the figures the code before the move
computed (golden_losses.json, written by golden_losses.py from main at 932bbce), with backend.loss=full; the
default fused loss (backend.loss=chunked) reproduces its own record (golden_losses_chunked.json) bit for bit.
Both records were rewritten by golden_losses.py once since, on purpose: when the local dispatcher's routing
weights moved before the experts' down projection (1-process figures within 2 float32 ulps, routing unchanged)."""
import importlib.util
import json
from pathlib import Path

import pytest

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("golden_losses", HERE / "golden_losses.py")
golden = importlib.util.module_from_spec(spec)
spec.loader.exec_module(golden)


# The loss, gradient norm and aux loss are reductions reported once per step. On a Sapphire Rapids (AVX512 + AMX)
# under the same pins (golden_losses.py), step 2's loss came out one float32 ulp from the fixture's, and a later
# gradient norm two, while every later loss and every routing count matched exactly: the trajectory was the
# same, the reporting reduction rounded apart. A few ulps of float32 are allowed for these; a change to the math
# moves them by far more and moves the routing counts.
REDUCED = ("loss", "grad_norm", "aux_loss")
ULPS = 4 * 2.0 ** -23  # four float32 ulps, relative


@pytest.mark.parametrize("loss", ["full", "chunked"])
@pytest.mark.parametrize("layout", ["1proc", "ep2"])
def test_figures_bit_identical_to_before_the_move(layout, loss, tmp_path):
    expected = json.loads(golden.LOSSES[loss][0].read_text())
    assert expected["overrides"] == golden.OVERRIDES
    figures = golden.run_layout(layout, tmp_path / layout, loss)
    assert len(figures["loss"]) == 4
    for key, values in expected["layouts"][layout].items():
        if key in REDUCED:  # a reported scalar: its last reduction may round apart on another CPU kind
            assert figures[key] == pytest.approx(values, rel=ULPS, abs=0), key
        else:  # routing counts and drops: exact
            assert figures[key] == values, key
