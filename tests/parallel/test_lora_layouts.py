"""LoRA under FSDP=2, EP=2 and CP=2 x EP=2 (gloo) reproduces the single-process LoRA run: the loss of every step and every
parameter after the run (adapters sharded like their base weights, expert adapters split along E by EP), and
the frozen base is still the seed's."""
import pytest
import torch

from moelab.model.lora import is_adapter

pytestmark = pytest.mark.slow

# attention, dense MLP and routed-expert adapters; the router trains too (SMALL moves the aux-free bias)
LORA = ("train.lora.rank=4", "train.lora.alpha=8", "train.lora.targets=attention,dense_mlp,experts",
        "train.lora.train_router=true", "train.lr=1e-2")


CP = ("model.moe.capacity_factor=0", "backend.attention=eager")  # as test_equivalence's cp2xep2
LAYOUTS = {"fsdp2": ([], ()), "ep2": (["parallel.ep=2"], ()), "cp2xep2": (["parallel.cp=2", "parallel.ep=2"], CP)}
# CP computes attention per query chunk: other arithmetic than one whole-sequence kernel, not only another order,
# so its parameter bound is test_equivalence's for CP (what a kernel change does to this run); every other
# bound, and CP's losses, come from what the layout reorders (conftest.layout_bounds)
PARAM_TOL = {"cp2xep2": (5e-4, 1e-3)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_reproduces_single_process(name, reference, helpers, tmp_path):
    overrides, shared = LAYOUTS[name]
    ref_losses, ref_params, _ = reference(*LORA, *shared)
    base_losses, base_params, _ = reference(*shared)
    cfg = helpers.small_config(*LORA, *shared, *overrides)
    bounds = helpers.layout_bounds(cfg)
    losses, params = helpers.run_multi(cfg, tmp_path, 2)
    assert len(losses) == len(ref_losses) == 4
    assert losses == pytest.approx(ref_losses, rel=bounds.rel, abs=0)
    assert losses != pytest.approx(base_losses, rel=1e-3)  # the adapters did train (and differ from full training)
    assert params.keys() == ref_params.keys()
    adapters = [k for k in params if is_adapter(k)]
    assert any(".experts.lora_" in k for k in adapters) and any("q_proj.lora_A" in k for k in adapters)
    # Adam turns rounding noise in near-zero gradients (A's, while B is near zero) into updates of up to lr: a
    # bound on the absolute difference from lr, and the relative norm from the reductions (layout_bounds)
    max_abs, max_rel = PARAM_TOL.get(name, (bounds.abs, bounds.rel))
    diff = helpers.assert_within(params, ref_params, bounds, max_abs, max_rel)
    print(f"{name}: worst relative norm {max(d[1] for d in diff.values()):.3g} (bound {max_rel:.3g}), "
          f"max abs {max(d[0] for d in diff.values()):.3g} (bound {max_abs:.3g})")
    fresh = helpers.small_config(*shared).replace(**{"train.steps": 1})
    from moelab.model import build_model

    seed_base = build_model(fresh).state_dict()
    for key, value in params.items():  # frozen: the base weights are the seed's, on every layout
        if not is_adapter(key) and ".router." not in key:
            assert torch.equal(value, seed_base[key].float()), key
