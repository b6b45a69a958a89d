"""Lean FSDP (moelab.parallel.fsdp): the rules for what FSDP2 wraps and reshards, the config's refusals, the
planner's gathered term, AdamW over a model mixing DTensor and plain parameters, and bf16 gradient reduction
on gloo against one process. Which parameters each layout leaves plain, and the reshard / prefetch settings
FSDP2 received, are checked on the real layouts in test_equivalence.py (check_placement)."""
import subprocess
import sys
import textwrap

import pytest
import torch

from moelab.config import ConfigError, load_config
from moelab.layout.dims import fsdp_wraps, reshard_after_forward
from moelab.planner.plan import plan


def test_one_rank_meshes_are_wrapped_only_for_the_bf16_cast():
    fp32, bf16 = load_config("tiny"), load_config("tiny", ["train.dtype=bfloat16"])
    bf16_params = load_config("tiny", ["train.dtype=bfloat16", "train.param_dtype=bfloat16"])
    assert fsdp_wraps(2, fp32) and fsdp_wraps(2, bf16) and fsdp_wraps(2, bf16_params)
    assert not fsdp_wraps(1, fp32) and not fsdp_wraps(1, bf16_params)
    assert fsdp_wraps(1, bf16)  # FSDP2's MixedPrecisionPolicy is the cast of fp32 weights to bf16


def test_reshard_after_forward_follows_torchtitan_by_default():
    assert [reshard_after_forward("default", 1, last) for last in (False, True)] == [True, False]
    assert [reshard_after_forward("default", 2, last) for last in (False, True)] == [False, False]
    assert all(reshard_after_forward("always", pp, last) for pp in (1, 2) for last in (False, True))
    assert not any(reshard_after_forward("never", pp, last) for pp in (1, 2) for last in (False, True))


def test_mixed_precision_policy_carries_the_reduce_dtype():
    from moelab.parallel.fsdp import mixed_precision

    assert mixed_precision(load_config("tiny")) is None
    mp = mixed_precision(load_config("tiny", ["train.dtype=bfloat16"]))
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    mp = mixed_precision(load_config("tiny", ["train.dtype=bfloat16", "parallel.reduce_dtype=bfloat16"]))
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    mp = mixed_precision(load_config("tiny", ["parallel.reduce_dtype=bfloat16"]))  # fp32 compute, bf16 reduce
    assert (mp.param_dtype, mp.reduce_dtype) == (None, torch.bfloat16)


@pytest.mark.parametrize("overrides, field", [
    (["parallel.reduce_dtype=bfloat16", "parallel.data_parallel=ddp"], "parallel.reduce_dtype='bfloat16'"),
    (["parallel.reduce_dtype=bfloat16", "parallel.expert_dp=replicate", "parallel.ep=2"],
     "parallel.reduce_dtype='bfloat16'"),
    (["parallel.reshard_after_forward=sometimes"], "parallel.reshard_after_forward='sometimes'"),
    (["parallel.fsdp_prefetch=eager"], "parallel.fsdp_prefetch='eager'"),
    (["parallel.fsdp_grad_sync=sometimes"], "parallel.fsdp_grad_sync='sometimes'"),
    # torch's pipeline schedule reduces FSDP2's gradients once per step: micro_batch cannot be honoured
    (["parallel.fsdp_grad_sync=micro_batch", "parallel.pp=2"], "parallel.fsdp_grad_sync='micro_batch'.*pp=1"),
    # nothing is FSDP2's to sync once per step
    (["parallel.fsdp_grad_sync=step", "parallel.data_parallel=ddp", "parallel.expert_dp=replicate"],
     "parallel.fsdp_grad_sync='step'.*auto"),
])
def test_config_refuses_what_fsdp2_would_not_do(overrides, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
        load_config("tiny", overrides)


def test_planner_counts_blocks_kept_gathered_and_skips_one_rank_meshes():
    base = ["train.dtype=bfloat16", "train.param_dtype=bfloat16", "train.global_batch_size=8"]
    gathered = lambda *o, gpus=2: plan(load_config("qwen3-moe-30b-a3b-proxy", base + list(o)),  # noqa: E731
                                       gpus=gpus).memory["gathered_params"]
    default, never = gathered(), gathered("parallel.reshard_after_forward=never")
    always = gathered("parallel.reshard_after_forward=always")
    assert never > default == always > 0  # always and default differ only in the last block, counted anyway
    # EP over both ranks: the experts are plain (nothing gathered for them), the dense blocks still are
    assert 0 < gathered("parallel.ep=2") < default
    assert gathered("parallel.ep=2", "parallel.expert_reshard_after_forward=never") == gathered("parallel.ep=2")
    assert gathered("parallel.pp=2") == 0  # one rank per stage, bf16 weights: nothing wrapped


def test_adamw_groups_by_parameter_kind(tmp_path):
    """In a one-rank gloo process: one group mixing DTensor and plain parameters is refused by fused and
    foreach AdamW (the failure this grouping fixes); build_optimizer's groups are accepted by both."""
    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from moelab.config import load_config
        from moelab.train.optim import build_optimizer

        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))  # DTensors; model[1] stays plain
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        for impl in ("fused", "foreach"):
            try:
                torch.optim.AdamW(list(model.parameters()), **{{impl: True}}).step()
                raise SystemExit(f"{{impl}} AdamW took a mixed group")
            except RuntimeError as e:
                assert "mixed torch.Tensor and DTensor" in str(e), e
        groups = build_optimizer(model, load_config("tiny")).param_groups
        print(sorted(g["name"] for g in groups))
        for impl in ("fused", "foreach"):
            torch.optim.AdamW(groups, **{{impl: True}}).step()
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "['decay/mesh[0]', 'decay/plain', 'no_decay/mesh[0]', 'no_decay/plain']"


@pytest.mark.slow
def test_bf16_gradient_reduction_against_one_process(reference, helpers, tmp_path):
    """FSDP=2 reducing gradients in bf16 (fp32 compute and weights): every gradient is rounded to bf16 before
    the sum over ranks, so the losses leave the one-process ones, by at most 1e-3 relative over 4 steps."""
    ref_losses, _, ref_dir = reference()
    losses, _ = helpers.run_multi(helpers.small_config("parallel.reduce_dtype=bfloat16"), tmp_path, 2)
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-6)  # step 1's loss comes before any update
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    print(f"\nbf16 reduce: relative loss difference per step {['%.2e' % r for r in rel]}")
    assert max(rel) < 1e-3
    assert max(rel[1:]) > 0  # the rounding is real: bf16 reduction is not a no-op on gloo
    norms = [e["grad_norm"] for e in helpers.step_events(tmp_path)]
    ref_norms = [e["grad_norm"] for e in helpers.step_events(ref_dir)]
    assert norms == pytest.approx(ref_norms, rel=1e-2)
