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
# (max abs, relative norm) parameter differences; CP's per-chunk attention rounds otherwise (test_equivalence)
PARAM_TOL = {"cp2xep2": (5e-4, 1e-3)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_reproduces_single_process(name, reference, helpers, tmp_path):
    overrides, shared = LAYOUTS[name]
    ref_losses, ref_params, _ = reference(*LORA, *shared)
    base_losses, base_params, _ = reference(*shared)
    losses, params = helpers.run_multi(helpers.small_config(*LORA, *shared, *overrides), tmp_path, 2)
    assert len(losses) == len(ref_losses) == 4
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert losses != pytest.approx(base_losses, rel=1e-3)  # the adapters did train (and differ from full training)
    assert params.keys() == ref_params.keys()
    adapters = [k for k in params if is_adapter(k)]
    assert any(".experts.lora_" in k for k in adapters) and any("q_proj.lora_A" in k for k in adapters)
    # as test_equivalence: Adam turns rounding noise in near-zero gradients (A's, while B is near zero) into
    # updates of up to lr, so a bound on the absolute difference and a tight one on the relative norm
    worst = {}
    max_abs, max_rel = PARAM_TOL.get(name, (1e-4, 1e-5))
    for key, ref in ref_params.items():
        assert params[key].shape == ref.shape, key
        assert (params[key] - ref).abs().max().item() < max_abs, key
        worst[key] = ((params[key] - ref).norm() / ref.norm().clamp(min=1e-12)).item()
    assert max(worst.values()) < max_rel, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    fresh = helpers.small_config(*shared).replace(**{"train.steps": 1})
    from moelab.model import build_model

    seed_base = build_model(fresh).state_dict()
    for key, value in params.items():  # frozen: the base weights are the seed's, on every layout
        if not is_adapter(key) and ".router." not in key:
            assert torch.equal(value, seed_base[key].float()), key
