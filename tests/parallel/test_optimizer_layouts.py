"""train.optimizer=adamw_triton (one Triton kernel per tensor, run by Triton's CPU interpreter here) on gloo
processes with FSDP2 (DTensor shards updated through their local rows), EP and DDP reproduces the single-process
run with torch's AdamW: the losses of every step and every parameter after 4 steps, as tightly as the layouts'
own equivalence tests hold torch's AdamW (tests/parallel/test_equivalence.py)."""
import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

LAYOUTS = {"fsdp2": (2, []), "ep2": (2, ["parallel.ep=2"]), "ddp2": (2, ["parallel.data_parallel=ddp"])}
# every tiny tensor of 64 elements or more goes through the kernel (the norms' and routers' vectors of fewer
# through torch's step, as on a GPU below MIN_NUMEL)
INTERPRET = {"TRITON_INTERPRET": "1", "TEST_TRITON_MIN_NUMEL": "64"}


@pytest.mark.parametrize("name", LAYOUTS)
def test_triton_adamw_layout_reproduces_torch_adamw(name, reference, helpers, tmp_path):
    import json

    nproc, overrides = LAYOUTS[name]
    ref_losses, ref_params, _ = reference("train.optimizer=adamw")
    cfg = helpers.small_config("train.optimizer=adamw_triton", *overrides)
    losses, params = helpers.run_multi(cfg, tmp_path, nproc, env=INTERPRET)
    bounds = helpers.layout_bounds(cfg)  # the layout's reordered sums (conftest.layout_bounds)
    assert losses == pytest.approx(ref_losses, rel=bounds.rel, abs=0)
    helpers.assert_within(params, ref_params, bounds)
    # the ranks stepped with TritonAdamW (rank_entry records the optimizer's class)
    assert json.loads((tmp_path / "placement_rank1.json").read_text())["optimizer"] == "TritonAdamW"
