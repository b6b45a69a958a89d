"""The planner's FP8 term (moelab.planner.fp8): the routed experts' e4m3 weight cache, kept with several micro
batches per step, is as large as the cache moelab.model.fp8_cache really allocates."""
import torch

from moelab.config import load_config
from moelab.model import MoETransformer
from moelab.model.fp8_cache import expert_weights_cached
from moelab.model.fp8_convert import enable_fp8
from moelab.planner.plan import plan

SETTINGS = ["train.dtype=bfloat16", "train.param_dtype=bfloat16", "train.fp8=rowwise", "train.micro_batch_size=2"]


def test_the_fp8_cache_term_is_the_real_caches_bytes_and_only_with_several_micro_batches():
    cfg = load_config("tiny", SETTINGS + ["train.global_batch_size=8"])
    model = MoETransformer(cfg.model, cfg.backend).to(torch.bfloat16)
    enable_fp8(model)
    with expert_weights_cached(model, torch.bfloat16) as caches:
        cached = sum(t.numel() * t.element_size() for c in caches for weight in c.buffers for t in weight)
    assert cached > 0 and plan(cfg).memory["fp8_weights"] == cached
    one = plan(cfg.replace(**{"train.global_batch_size": 2}))  # one micro batch: quantised per GEMM, not kept
    assert one.micro_batches_per_step == 1 and one.memory["fp8_weights"] == 0
    assert plan(cfg.replace(**{"train.fp8": "off"})).memory["fp8_weights"] == 0
    # experts that FSDP2 shards are DTensors, which are not cached
    assert plan(cfg.replace(**{"parallel.fsdp": 2, "train.global_batch_size": 16}), gpus=2).memory["fp8_weights"] == 0
