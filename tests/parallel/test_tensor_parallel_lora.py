"""LoRA under tensor parallelism (moelab.parallel.tensor._shard_adapters) on gloo processes reproduces the
single-process LoRA run: losses, routing counts, gradient norms and every parameter after 4 AdamW steps, within
test_tensor_parallel's bounds (TP changes the order of fp32 sums only; see that module's docstring); the frozen
base stays the seed's; a TP run's checkpoint exports merged (transformers' logits equal moelab's merged model) and
as PEFT adapters.

Placement: a column-parallel base's A replicated and B sharded by output rows; a row-parallel base's A sharded by
input columns and B replicated; MLA's latent projections (repeated on every rank) keep replicated adapters; the
routed experts' grouped adapters follow EP.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from moelab.model.lora import is_adapter

pytestmark = pytest.mark.slow

SHARED = ("model.moe.capacity_factor=0", "model.moe.bias_update_rate=0")  # as test_tensor_parallel's
LORA = ("train.lora.rank=4", "train.lora.alpha=8", "train.lora.targets=attention,dense_mlp,experts",
        "train.lora.train_router=true", "train.lr=1e-2")
LR = 1e-2
DEEPSEEK = ("model.attention=mla", "model.num_kv_heads=4", "model.q_lora_rank=12", "model.kv_lora_rank=8",
            "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=8",
            "model.moe.score_func=sigmoid", "model.moe.num_shared_experts=1", "model.moe.num_groups=4",
            "model.moe.topk_groups=2", "model.moe.route_scale=2.5",
            "train.lora.targets=attention,dense_mlp,shared_experts,experts")
LAYOUTS = {  # name: (processes, overrides of the reference and the TP run alike, TP layout)
    # Qwen3's QK norms; the attention's adapters only, the router frozen: the export test writes PEFT adapters
    "tp2": (2, ("model.qk_norm=true", "train.lora.targets=attention", "train.lora.train_router=false"),
            ["parallel.tp=2"]),
    # q_a/kv_a repeated, q_b/kv_b column-parallel; the router frozen: trained at lr 1e-2, TP's rounding moved one
    # token's sigmoid group-limited choice at a near-tie on step 3 (OMP_NUM_THREADS=1), and the runs then part
    "tp2-deepseek": (2, (*DEEPSEEK, "train.lora.train_router=false"), ["parallel.tp=2"]),
    "tp2xfsdp2": (4, (), ["parallel.tp=2"]),  # adapters FSDP2-sharded on the 2-D mesh
    # GPT-OSS: biased projections (a column-parallel base's bias sharded, a row-parallel one's replicated), sinks
    "tp2-gptoss": (2, ("model.attention_sinks=true", "model.sliding_window=4", "model.num_dense_layers=0",
                       "model.attention_bias=true", "model.moe.router_bias=true", "model.moe.expert_proj_bias=true",
                       "model.moe.score_func=softmax_topk", "model.moe.norm_topk_prob=false",
                       "model.moe.activation=gpt_oss", "backend.attention=eager",
                       "train.lora.targets=attention,experts"), ["parallel.tp=2"]),
}


@pytest.fixture(scope="module")
def lora_run(helpers, tmp_path_factory):
    """lora_run(name) -> (config, losses, gathered parameters, run folder) of a layout, run once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            nproc, common, layout = LAYOUTS[name]
            cfg = helpers.small_config(*SHARED, *LORA, *common, *layout)
            run_dir = tmp_path_factory.mktemp(name)
            cache[name] = (cfg, *helpers.run_multi(cfg, run_dir, nproc), run_dir)
        return cache[name]

    return get


@pytest.mark.parametrize("name", LAYOUTS)
def test_lora_under_tp_reproduces_single_process(name, reference, helpers, lora_run):
    ref_losses, ref_params, ref_dir = reference(*SHARED, *LORA, *LAYOUTS[name][1])
    cfg, losses, params, run_dir = lora_run(name)
    assert len(losses) == 4 and losses[0] == pytest.approx(ref_losses[0], rel=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(run_dir)
    assert [e["routing"]["tokens_per_expert"] for e in ev] == [e["routing"]["tokens_per_expert"] for e in ref_ev]
    assert [e["grad_norm"] for e in ev] == pytest.approx([e["grad_norm"] for e in ref_ev], rel=1e-4)
    helpers.assert_within(params, ref_params, None, max_abs=LR / 3, max_rel=2e-3)
    adapters = [k for k in params if is_adapter(k)]
    # column- and row-parallel bases (q_proj, o_proj), and where targeted the dense MLP's down_proj (row-parallel)
    # and the routed experts
    assert any(k.endswith("q_proj.lora_A") or k.endswith("q_b_proj.lora_A") for k in adapters)
    assert any(k.endswith("o_proj.lora_B") for k in adapters)
    targets = cfg.train.lora.targets.split(",")
    assert ("dense_mlp" in targets) == any(".ffn.down_proj.lora_B" in k for k in adapters)
    assert ("experts" in targets) == any(".experts.lora_" in k for k in adapters)
    # every adapter of rank 0 is a DTensor (placed on the TP mesh), none left a plain tensor
    placed = json.loads((run_dir / "placement_rank0.json").read_text())["params"]
    assert all(kind == "dtensor" for key, kind in placed.items() if is_adapter(key)), placed
    adapter_moved = [k for k in adapters if "lora_B" in k or "lora_b_" in k]
    assert all(params[k].abs().max() > 0 for k in adapter_moved)  # B starts at zero: the adapters trained
    from moelab.model import build_model

    seed = build_model(helpers.small_config(*SHARED, *LAYOUTS[name][1])).state_dict()
    for key, value in params.items():  # frozen: the base weights are the seed's
        if not is_adapter(key) and ".router." not in key:
            assert torch.equal(value, seed[key].float()), key


def _export_helpers():
    """tests/hf/test_export_hf.py's comparison of transformers' logits with moelab's model."""
    path = Path(__file__).parents[1] / "hf" / "test_export_hf.py"
    spec = importlib.util.spec_from_file_location("_test_export_hf_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tp_lora_run_exports_merged_and_as_adapters(helpers, lora_run, tmp_path):
    """The checkpoint of a TP LoRA run (each rank's adapter shards) exports merged: transformers' logits are those
    of a plain model holding the run's gathered parameters with the adapters folded in; and as PEFT's files."""
    pytest.importorskip("transformers")
    from moelab.export.hf import export_hf
    from moelab.model import build_model
    from moelab.model.lora import merge_lora_state

    cfg, _, params, run_dir = lora_run("tp2")
    out = export_hf(run_dir, tmp_path / "merged")
    model = build_model(helpers.small_config(*SHARED, *LAYOUTS["tp2"][1])).eval()
    assert not model.load_state_dict(merge_lora_state(params, cfg), strict=False).unexpected_keys
    _export_helpers().assert_same_logits(out, model, cfg.model.vocab_size)
    adapters = export_hf(run_dir, tmp_path / "adapters", lora="adapters")
    assert sorted(p.name for p in adapters.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    from safetensors import safe_open

    with safe_open(str(adapters / "adapter_model.safetensors"), "pt") as f:  # every rank's shards, whole
        written = sorted(f.get_tensor(k).numel() for k in f.keys())
    assert written == sorted(v.numel() for k, v in params.items() if is_adapter(k))
