"""The planner's activation accounting (moelab.planner.saved) against the tensors autograd really keeps for one
real block, eager and through inductor's partitioner (the aot_eager_decomp_partition backend: inductor's
decompositions and min-cut partitioning without its code generation), in bf16 with the grouped GEMM as on a GPU;
the on-tokens experts (backend.experts=triton_fused) under Triton's interpreter, and SonicMoE's count against the
GPU record of its layer."""
import json
import os
from pathlib import Path

import pytest
import torch

import moelab.model.experts as experts_module
import moelab.model.router as router_module
from moelab.config import load_config
from moelab.model.layers import rope_cos_sin
from moelab.model.experts import GroupedExperts
from moelab.model.transformer import Block
from moelab.planner.saved import ON_TOKENS, on_tokens_experts, saved_per_token
from support import pytest_under_interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SONIC_RECORD = (Path(__file__).parents[2] / "gallery" / "results" /
                "qwen3-moe-30b-a3b-proxy--moelab--moe-layer-sonic-backend-call10.json")

SHAPES = ["model.hidden_size=128", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=32",
          "model.dense_ffn_size=256", "model.moe.expert_ffn_size=96", "model.moe.num_experts=8",
          "train.dtype=bfloat16", "train.param_dtype=bfloat16"]
MLA = ["model.attention=mla", "model.q_lora_rank=64", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16",
       "model.qk_rope_head_dim=16", "model.v_head_dim=32"]  # v as wide as q.k: CPU's flash kernel, as on a GPU
CASES = {
    "gqa-qk-norm-learned": ["model.qk_norm=true"],
    "gqa-fake-gate": ["backend.fake_balanced_gate=true"],
    "gqa-shared-gpt-oss-experts": ["model.moe.num_shared_experts=1", "model.moe.activation=gpt_oss",
                                   "model.moe.expert_proj_bias=true"],
    "mla-shared": MLA + ["model.moe.num_shared_experts=1"],
    "lora-attention": ["train.lora.rank=4", "train.lora.targets=attention"],
}
L = 256


def _kept_bytes(out: torch.Tensor, exclude: set) -> int:
    """Bytes of every tensor the autograd graph of `out` keeps (storages counted once), except `exclude`'s."""
    seen, stack, done = {}, [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in done:
            continue
        done.add(node)
        tensors = list(getattr(node, "saved_tensors", ()) or ())
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                tensors += [value] if isinstance(value, torch.Tensor) else \
                    [t for t in value if isinstance(t, torch.Tensor)] if isinstance(value, (list, tuple)) else []
        for t in tensors:
            if t is None:  # an operand a Function keeps only for a gradient nobody needs
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in exclude:
                seen[storage.data_ptr()] = storage.nbytes()
        stack += [f for f, _ in node.next_functions]
    return sum(seen.values())


def _block_kept(cfg, index: int, compiled: bool) -> int:
    from moelab.model.lora import apply_lora

    torch.manual_seed(0)
    m = cfg.model
    block = Block(m, cfg.backend, index)
    if cfg.train.lora.rank:
        holder = torch.nn.Module()
        holder.layers = torch.nn.ModuleDict({str(index): block})
        apply_lora(holder, cfg)
    for module in block.modules():
        if isinstance(module, GroupedExperts) and cfg.backend.experts in ON_TOKENS:
            module.impl = cfg.backend.experts  # as moelab.backends.apply_backends sets it where the kernels run
    block = block.to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    L = cfg.train.seq_len
    x = torch.randn(1, L, m.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(L), m.qk_rope_head_dim if m.attention == "mla" else m.head_dim,
                            m.rope_theta, torch.bfloat16)
    if compiled:
        block.compile(backend="aot_eager_decomp_partition")
    out = block(x, cos, sin)
    exclude = {p.untyped_storage().data_ptr() for p in block.parameters()} | \
        {t.untyped_storage().data_ptr() for t in (cos, sin)}
    return _kept_bytes(out, exclude)


@torch.library.custom_op("moelab_test::mm_f32", mutates_args=())
def _mm_f32_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.float() @ b.float()


@_mm_f32_op.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)


@pytest.fixture
def grouped_mm_in_bf16(monkeypatch):
    """The GPU paths: the routed experts' torch._grouped_mm in bf16 (torch also runs it on CPU) and the router's
    one-op fp32-output GEMM of bf16 operands (torch.mm's out_dtype, CUDA only; here an opaque op, so that the
    partitioner sees no fp32 upcast to keep)."""
    monkeypatch.setattr(experts_module, "grouped_mm_supported", lambda x, *dims: True)
    monkeypatch.setattr(router_module, "_mm_f32", _mm_f32_op)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_bytes_per_token_are_what_a_real_block_keeps(name, compiled, grouped_mm_in_bf16):
    cfg = load_config("tiny", SHAPES + CASES[name] + [f"train.compile={compiled}", f"train.seq_len={L}"])
    torch._dynamo.reset()
    m = cfg.model
    # CPU's flash kernel writes its output in q's layout: MLA's q is concatenated [B, H, L, Dq], so the output
    # projection reads a copy ([B, L, H, Dv] on the GPU kernels, which the planner counts)
    cpu_copy = 2 * m.num_heads * m.v_head_dim if m.attention == "mla" else 0
    for index, moe in ((m.num_layers - 1, True), (0, False)):
        per = saved_per_token(cfg, moe, a=2)
        planned = L * (per["attention"] + per["ffn"] + cpu_copy)
        assert _block_kept(cfg, index, compiled) == pytest.approx(planned, rel=0.03), (name, "moe" if moe else "dense")


def test_compiled_blocks_keep_less_and_the_fake_gate_less_than_the_learned_router():
    base = load_config("qwen3-moe-30b-a3b-proxy", ["train.dtype=bfloat16", "train.param_dtype=bfloat16"])
    total = lambda cfg: sum(v for k, v in saved_per_token(cfg, True, 2).items() if k != "input")  # noqa: E731
    eager, compiled = total(base), total(base.replace(**{"train.compile": True}))
    fake = total(base.replace(**{"backend.fake_balanced_gate": True}))
    assert compiled < 0.75 * eager and fake < eager
    ep = total(base.replace(**{"parallel.ep": 2}))
    K, D, F = base.model.moe.top_k, base.model.hidden_size, base.model.moe.expert_ffn_size
    # EP weights the expert output at combine (kept for the weights' gradient, where the local path keeps the
    # activation before its weighting) and its way back keeps two index_copy sources, where the local path's
    # gathers (moelab.model.rows) keep none
    assert ep - eager == K * 2 * (D - F) + 2 * K * 2 * D
    ep_compiled = total(base.replace(**{"parallel.ep": 2, "train.compile": True}))
    assert ep_compiled - compiled == 3 * K * 2 * D  # compiled, the local path keeps neither


def test_on_tokens_experts_under_the_interpreter():
    """backend.experts=triton_fused runs on a CPU only under Triton's interpreter, which has to be on before triton
    is imported: the block tests below run in a subprocess with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the subprocess")
    pytest_under_interpreter(__file__, 6, "-k", "fused_experts_block")


@pytest.mark.skipif(not INTERPRETED, reason="run by test_on_tokens_experts_under_the_interpreter")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", [[], ["model.moe.num_shared_experts=1"], ["backend.fake_balanced_gate=true"]],
                         ids=["learned", "shared", "fake-gate"])
def test_fused_experts_block_keeps_what_the_planner_counts(case, compiled, grouped_mm_in_bf16):
    """The kernels keep the tokens, gate|up and the rows' metadata, no routed copy: the MoE block keeps about 0.7x
    (eager) / 0.8x (compiled) what the sorted rows' path keeps at these shapes, and the planner counts it."""
    tokens = 64  # the interpreter runs each kernel instance in numpy: few rows
    cfg = load_config("tiny", SHAPES + case + ["model.moe.capacity_factor=0", "backend.experts=triton_fused",
                                               f"train.compile={compiled}", f"train.seq_len={tokens}"])
    torch._dynamo.reset()
    per = saved_per_token(cfg, True, a=2)
    kept = _block_kept(cfg, cfg.model.num_layers - 1, compiled)
    assert kept == pytest.approx(tokens * (per["attention"] + per["ffn"]), rel=0.03)
    rows = saved_per_token(cfg.replace(**{"backend.experts": "auto"}), True, a=2)
    assert kept < 0.9 * tokens * (rows["attention"] + rows["ffn"])


def test_sonic_count_is_what_its_gpu_layer_kept():
    """SonicMoE's saved activations at the Qwen3 proxy's layer (issue 41 call 10, one H100: moelab's sonic path
    and SonicMoE called directly, the tokens and routing weights being the layer's inputs): the planner's count
    of what its two Functions keep (gate|up, the routing weight and three int32 indices per row, per-token
    offsets)."""
    record = json.loads(SONIC_RECORD.read_text())
    cfg = load_config("qwen3-moe-30b-a3b-proxy", ["backend.experts=sonic"])
    shapes = record["shapes"]
    assert (shapes["top_k"], shapes["expert_ffn"]) == (cfg.model.moe.top_k, cfg.model.moe.expert_ffn_size)
    for variant in ("moelab-sonic-eager", "sonicmoe-default-config"):
        measured = record["results"]["skewed"][variant]["saved_bytes_hooks_activations"]
        assert shapes["tokens"] * on_tokens_experts(cfg, a=2) == pytest.approx(measured, rel=1e-4), variant
