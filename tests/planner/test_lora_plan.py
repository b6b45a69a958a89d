"""The planner under train.lora (moelab.planner.lora): the adapters it counts are the real model's, and only they
carry gradients and AdamW state in the memory estimate."""
import pytest
import torch

from moelab.config import load_config
from moelab.model import MoETransformer
from moelab.model.lora import apply_lora, is_adapter
from moelab.planner.plan import plan

LORA = ["train.lora.rank=4"]
CASES = {
    "gqa-attention-experts": ["train.lora.targets=attention,experts"],
    "gqa-everything-router": ["model.moe.num_shared_experts=2", "model.moe.router_bias=true",
                              "train.lora.targets=attention,dense_mlp,shared_experts,experts",
                              "train.lora.train_router=true"],
    "mla-q-lora": ["model.attention=mla", "model.q_lora_rank=32", "model.kv_lora_rank=16",
                   "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
                   "train.lora.targets=attention,dense_mlp"],
    "mla-no-q-lora-some": ["model.attention=mla", "model.q_lora_rank=0", "model.kv_lora_rank=16",
                           "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=24",
                           "train.lora.targets=q_proj,kv_b_proj,experts"],
}


def _meta_lora_model(cfg):
    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.backend)
    apply_lora(model, cfg)
    return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_trained_params_are_the_real_models(name):
    cfg = load_config("tiny", LORA + CASES[name])
    model = _meta_lora_model(cfg)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    p = plan(cfg)
    assert p.trained_params == trained
    assert p.params_per_gpu == p.total_params + adapters  # one process holds the base and every adapter
    assert p.memory["gradients"] == 4 * trained and p.memory["optimizer"] == 8 * trained
    assert "trained (LoRA)" in str(p)


@pytest.mark.parametrize("gpus,layout", [(2, ["parallel.ep=2"]), (2, ["parallel.fsdp=2"])])
def test_sharded_lora_counts_each_ranks_share(gpus, layout):
    cfg = load_config("tiny", LORA + ["train.lora.targets=attention,experts"] + layout)
    full = plan(load_config("tiny", layout), gpus=gpus)
    p = plan(cfg, gpus=gpus)
    assert p.trained_params * 4 / gpus == pytest.approx(p.memory["gradients"], rel=0.01)
    assert p.memory["gradients"] < full.memory["gradients"] / 10
    assert p.memory_per_gpu_bytes < full.memory_per_gpu_bytes


def test_lora_memory_terms_are_the_real_steps_tensors():
    """Weights, gradients and AdamW state of a real LoRA training step (fp32, CPU) against the plan's terms: the
    frozen base keeps its weights only, the adapters get gradients and two AdamW moments."""
    import torch.nn.functional as F

    cfg = load_config("tiny", ["model.num_layers=2", "train.seq_len=32", "train.micro_batch_size=2",
                               "train.global_batch_size=2", "train.lora.rank=8",
                               "train.lora.targets=attention,experts"])
    model = _meta_lora_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(cfg.train.seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    grads = nbytes(p.grad for p in model.parameters() if p.grad is not None)
    moments = nbytes(v for st in opt.state.values() for k, v in st.items() if k != "step")
    mem = plan(cfg).memory
    assert mem["parameters"] == nbytes(model.parameters())
    assert (mem["gradients"], mem["optimizer"]) == (grads, moments)
