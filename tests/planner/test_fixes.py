"""A plan that does not fit says what to change (moelab.planner.fixes): a concrete setting, aimed at the biggest
memory term, that plans within the GPU; and it predicts no speed."""
from moelab.config import load_config
from moelab.planner.fixes import fitting_change, set_text
from moelab.planner.plan import plan


def test_the_presets_own_deepseek_layout_names_a_setting_that_fits_and_predicts_no_speed():
    p = plan(load_config("deepseek-v3"), gpus=256, gpu="h100")
    assert not p.fits and p.speed is None and p.biggest_term == "optimizer"
    assert "Fits with --set train.optimizer_state=bf16_moments" in p.verdict
    fixed = plan(load_config("deepseek-v3", {"train.optimizer_state": "bf16_moments"}), gpus=256, gpu="h100")
    assert fixed.fits and fixed.speed is not None
    assert f"{fixed.memory_per_gpu_bytes / 2**30:.1f} GiB per GPU" in p.verdict


def test_a_change_keeps_the_world_and_may_take_two_settings():
    cfg = load_config("deepseek-v3", {"train.optimizer_state": "bf16_moments"})
    change, fitted = fitting_change(cfg, "gathered_params", lambda c: plan(c, gpus=256, gpu_memory_gb=60.0,
                                                                           suggest=False))
    assert fitted.fits and fitted.gpus == 256 and fitted.memory_per_gpu_bytes <= 0.95 * 60 * 2**30
    # the layout names fsdp=64: doubling tp halves it, so tp*pp*cp*fsdp stays 256
    assert change == {"parallel.tp": 2, "parallel.fsdp": 32}
    assert set_text(change) == "--set parallel.tp=2 --set parallel.fsdp=32"


def test_nothing_that_fits_says_so():
    p = plan(load_config("tiny"), gpu_memory_gb=1e-6)
    assert not p.fits and "no single setting tried fits" in p.verdict and "more GPUs" in p.verdict
