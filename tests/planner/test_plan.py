"""The analytic planner: published parameter counts, agreement with real models, memory trends, verdicts, CLI."""
import copy
import json

import pytest
import torch

from moelab.cli import main
from moelab.config import load_config
from moelab.model import MoETransformer, build_model
from moelab.planner.stages import stage_layers
from moelab.planner.plan import plan, split_layers

# Published totals and activated parameters (model cards / papers), in billions, and the tolerance on totals.
# Activated counts are published with different conventions (embedding in or out), so they get 10%.
PUBLISHED = {
    "qwen3-moe-30b-a3b": (30.5, 3.3, 0.01),   # Qwen3-30B-A3B: 30.5B total, 3.3B activated
    "deepseek-v3": (671.0, 37.0, 0.01),       # DeepSeek-V3: 671B total, 37B activated
    "kimi-k2": (1040.0, 32.0, 0.03),          # Kimi K2: ~1.04T total, 32B activated
    "gpt-oss-20b": (21.0, 3.6, 0.03),         # gpt-oss-20b: 21B total, 3.6B active
    "gpt-oss-120b": (117.0, 5.1, 0.01),       # gpt-oss-120b: 117B total, 5.1B active
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name):
    total, active, tol = PUBLISHED[name]
    p = plan(load_config(name))  # analytic: no model is built, so even 1T parameters plan on a laptop
    assert p.total_params == pytest.approx(total * 1e9, rel=tol)
    assert p.activated_params == pytest.approx(active * 1e9, rel=0.10)


SMALL = {
    "tiny": [],
    "qk-norm-tied": ["model.qk_norm=true", "model.tie_embeddings=true"],
    "shared-experts": ["model.moe.num_shared_experts=2", "model.num_dense_layers=0"],
    "mla": ["model.attention=mla", "model.q_lora_rank=32", "model.kv_lora_rank=16", "model.qk_nope_head_dim=16",
            "model.qk_rope_head_dim=8", "model.v_head_dim=16"],
    "gpt-oss-like": ["model.sliding_window=16", "model.attention_sinks=true", "model.attention_bias=true",
                     "backend.attention=eager"],
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_param_count_equals_real_model(name):
    cfg = load_config("tiny", SMALL[name])
    model = build_model(cfg)
    real = sum(p.numel() for p in model.parameters())
    assert plan(cfg).total_params == real


def test_stage_params_equal_real_layers_under_pipeline():
    cfg = load_config("tiny", ["model.num_layers=6", "parallel.pp=2", "parallel.vp=3",
                               "parallel.pp_schedule=interleaved_1f1b"])
    p = plan(cfg, gpus=2)
    model = build_model(cfg)
    numel = lambda mod: sum(x.numel() for x in mod.parameters())
    for rank, layers in enumerate(p.stage_layers):
        real = sum(numel(model.layers[str(i)]) for i in layers)
        real += numel(model.tok_embeddings) if rank == 0 else 0
        real += numel(model.output) + numel(model.norm) if rank == 1 else 0
        assert p.stage_params[rank] == real
    assert sum(p.stage_params) == p.total_params
    assert p.pipeline["bubble_fraction"] == pytest.approx((2 - 1) / (3 * p.micro_batches_per_step + 2 - 1))


@pytest.mark.parametrize("name,pp,vp", [("tiny", 2, 1), ("tiny", 2, 2), ("tiny", 4, 1),
                                         ("qwen3-moe-30b-a3b-proxy", 2, 1), ("qwen3-moe-30b-a3b-proxy", 2, 2)])
def test_split_layers_are_the_layers_each_pipeline_rank_builds(name, pp, vp):
    """The planner's memory per stage needs the layers the pipeline really puts on each rank (a cost-balanced
    split puts 7 of the Qwen3 proxy's 8 layers on the first of two stages: the LM head weighs on the last)."""
    from moelab.parallel.pipeline import build_stage_modules

    cfg = load_config(name, [f"model.num_layers={max(8, pp * vp)}"])
    split = stage_layers(cfg.model, pp * vp)
    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.backend)
    for rank, layers in enumerate(split_layers(cfg.model, pp, vp)):
        stages = build_stage_modules(copy.deepcopy(model), split, [rank + k * pp for k in range(vp)])
        assert sorted(int(key) for stage in stages for key in stage.layers) == sorted(layers)
    assert sorted(sum(split_layers(cfg.model, pp, vp), [])) == list(range(cfg.model.num_layers))


def _saved_activation_bytes(cfg) -> int:
    """Bytes of the (non-parameter) tensors autograd saves in one forward of a micro batch, deduplicated."""
    model = build_model(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(seen.values())


@pytest.mark.parametrize("extra", [[], ["model.qk_norm=true", "model.moe.num_shared_experts=1"],
                                   ["backend.attention=eager"]])
def test_activation_estimate_matches_saved_tensors(extra):
    cfg = load_config("tiny", ["model.hidden_size=128", "model.vocab_size=64", "train.seq_len=64",
                               "train.micro_batch_size=2", "model.dense_ffn_size=256",
                               "model.moe.expert_ffn_size=128"] + extra)
    planned = plan(cfg).activations_per_micro_batch["none"]
    assert _saved_activation_bytes(cfg) == pytest.approx(planned, rel=0.15)


def test_memory_shrinks_as_fsdp_and_ep_grow():
    cfg = load_config("qwen3-moe-30b-a3b", ["parallel.fsdp=-1"])
    by_world = [plan(cfg, gpus=n, gpu_memory_gb=80) for n in (8, 16, 32)]
    mems = [p.memory_per_gpu_bytes for p in by_world]
    assert mems[0] > mems[1] > mems[2]
    assert by_world[0].params_per_gpu > by_world[1].params_per_gpu > by_world[2].params_per_gpu
    by_ep = [plan(load_config("qwen3-moe-30b-a3b", [f"parallel.ep={ep}"]), gpus=8, gpu_memory_gb=80)
             for ep in (1, 2, 8)]
    mems = [p.memory_per_gpu_bytes for p in by_ep]
    # expert-FSDP already shards the experts over the 8 ranks; EP=2 then keeps the returned expert outputs (the
    # routing weights applied at combine) that one rank's local dispatcher does not, so only wider EP shrinks it
    assert mems[0] > mems[2] and mems[1] > mems[2]
    assert by_ep[2].comm["all_to_all_bytes_per_moe_layer"] > by_ep[1].comm["all_to_all_bytes_per_moe_layer"] > 0
    assert by_ep[0].comm["all_to_all_bytes_per_moe_layer"] == 0


def test_checkpointing_and_pipeline_change_activations():
    cfg = load_config("qwen3-moe-30b-a3b", ["train.activation_checkpointing=none"])
    p = plan(cfg, gpus=8)
    a = p.activations_per_micro_batch
    assert a["none"] > a["selective"] > a["full"] > 0
    assert p.memory["activations"] == a["none"]
    full = plan(cfg.replace(**{"train.activation_checkpointing": "full"}), gpus=8)
    assert full.memory["activations"] == a["full"] < p.memory["activations"]


def test_verdict_names_the_biggest_term():
    states = plan(load_config("qwen3-moe-30b-a3b", ["parallel.ep=1"]), gpus=1, gpu_memory_gb=80)
    assert not states.fits and states.biggest_term == "optimizer"
    assert states.verdict.startswith("does not fit") and "optimizer" in states.verdict
    acts = plan(load_config("tiny", ["train.seq_len=8192", "train.activation_checkpointing=none"]),
                gpu_memory_gb=0.5)
    assert not acts.fits and acts.biggest_term == "activations"
    assert "activation_checkpointing=full" in acts.verdict
    ok = plan(load_config("tiny"), gpu_memory_gb=80)
    assert ok.fits and ok.verdict.startswith("fits")


def test_671b_on_its_published_layout_plans_fast():
    cfg = load_config("deepseek-v3", ["parallel.pp=4", "parallel.vp=8", "parallel.ep=64", "parallel.fsdp=64",
                                      "parallel.pp_schedule=interleaved_1f1b", "train.global_batch_size=512",
                                      "train.micro_batch_size=1"])
    p = plan(cfg, gpu_memory_gb=80)
    assert p.gpus == 256 and p.layout["efsdp"] == 1
    assert p.params_per_gpu == pytest.approx(671e9 / 256, rel=0.15)
    assert 0 < p.pipeline["bubble_fraction"] < 0.1
    assert p.comm["pipeline_send_bytes_per_step"] > 0 and p.comm["fsdp_all_gather_bytes_per_step"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default is this machine's GPU when there is one")
def test_default_gpu_memory_is_an_h100():
    p = plan(load_config("tiny"))
    assert p.gpu_memory_gb == 80 and "H100" in p.gpu_memory_source and "H100" in str(p)


def test_cli_json_and_text(capsys):
    assert main(["plan", "tiny", "--json", "--set", "train.seq_len=128", "--gpu-memory-gb", "40"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("total_params", "activated_params", "flops_per_token", "memory_per_gpu_bytes", "memory", "comm",
                "fits", "verdict"):
        assert key in d
    assert d["memory_per_gpu_bytes"] == sum(d["memory"].values())
    assert d["seq_len"] == 128 and d["gpu_memory_gb"] == 40
    assert main(["plan", "qwen3-moe-30b-a3b", "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU" in out and "verdict" in out and "FSDP 16" in out
    assert main(["plan", "qwen3-moe-30b-a3b", "--gpus", "3"]) == 2  # a layout error, not a traceback


def test_html_repr():
    html = plan(load_config("tiny"))._repr_html_()
    assert html.startswith("<table") and "verdict" in html and "memory per GPU" in html


@pytest.mark.parametrize("extra", [[], ["train.global_batch_size=4", "model.moe.top_k=4"]])
def test_peak_matches_tracked_memory_of_real_steps(extra):
    """The whole peak (weights, gradients, AdamW state, activations, logits) against torch's MemTracker over two
    real fp32 training steps on CPU, with gradient accumulation when there are two micro batches."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    import torch.nn.functional as F

    cfg = load_config("tiny", ["model.num_layers=2", "model.vocab_size=4096", "train.seq_len=64",
                               "train.micro_batch_size=4", "train.global_batch_size=8"] + extra)
    t = cfg.train
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, opt)
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1))
    with tracker:
        for _ in range(2):
            for _ in range(t.global_batch_size // t.micro_batch_size):
                logits = model(tokens[:, :-1])
                F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
                del logits
                tracker.reset_mod_stats()
            opt.step()
            opt.zero_grad(set_to_none=True)
    measured = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    assert measured == pytest.approx(plan(cfg).memory_per_gpu_bytes, rel=0.08)


@pytest.mark.parametrize("gpus,layout", [(1, []), (2, ["parallel.ep=2"]), (2, ["parallel.fsdp=2"])])
def test_a_start_from_a_checkpoint_counts_the_loading_peak(gpus, layout):
    """train.init_from adds the loading peak: the weights plus the largest tensor slice a rank loads, which is
    the largest parameter of the real model divided over the ranks sharing it (experts over ep x efsdp)."""
    overrides = ["model.vocab_size=512"] + layout
    base = plan(load_config("tiny", overrides), gpus=gpus)
    assert base.loading is None
    cfg = load_config("tiny", overrides + ["train.init_from=hf:/ckpt"])
    p = plan(cfg, gpus=gpus)
    with torch.device("meta"):
        model = MoETransformer(cfg.model)
    shares = [t.numel() / gpus for t in model.parameters()]  # dense over fsdp; experts over ep*efsdp
    biggest = max(shares)
    assert p.loading["largest_slice"] == pytest.approx(biggest, rel=0.01)
    assert p.loading["host_bytes"] == 12 * p.loading["largest_slice"]
    assert p.loading["device_bytes"] == 4 * (p.params_per_gpu + p.loading["largest_slice"])
    assert p.memory_per_gpu_bytes == max(base.memory_per_gpu_bytes, p.loading["device_bytes"])
    assert "while loading" in str(p)


@pytest.mark.parametrize("layout,experts_over", [(["parallel.data_parallel=ddp"], 1),
                                                 (["parallel.ep=2", "parallel.expert_dp=replicate"], 2)])
def test_a_replicated_layout_counts_the_placement_peak(layout, experts_over):
    """DDP and replicated experts need their weights before wrapping (moelab.parallel.distributed.place_stage):
    each rank allocates the dense weights whole and the experts split by EP only, then FSDP2 shards what it
    shards. The plan's placing figure is those bytes, part of the peak; FSDP2 alone wraps on the meta device."""
    cfg = load_config("tiny", layout)
    with torch.device("meta"):
        model = MoETransformer(cfg.model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in model.parameters()) - experts
    p = plan(cfg, gpus=2)
    assert p.placing_bytes == 4 * (dense + experts // experts_over)
    assert p.memory_per_gpu_bytes >= p.placing_bytes
    assert "while placing" in str(p) and plan(load_config("tiny")).placing_bytes == 0
    assert plan(load_config("tiny", ["parallel.fsdp=2"]), gpus=2).placing_bytes == 0
