"""Differential tests against transformers' own modeling code (eager attention, fp32, CPU) over non-default
configs: logits, the top-k expert set of every token in every MoE layer, every parameter's gradient (CE alone,
and CE + aux against transformers with output_router_logits=True), one optimizer step, and the save_hf ->
from_pretrained round trip, each at 1e-4 relative (to the tensor's largest value).

A fixed set of cases names the corners (top_k=1 with renormalisation, tied embeddings, padding, ...); a small
hypothesis budget draws further configs from the same space.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from moelab import load_hf, save_hf  # noqa: E402
from moelab.hf import adapter_for  # noqa: E402
from moelab.backends.full_loss import IGNORE_INDEX, cross_entropy, loss_mask  # noqa: E402

B, L, V = 2, 12, 96  # V: the vocabulary of conftest's models


def _topk_sets(model, routers, ids) -> list[torch.Tensor]:
    """Sorted expert indices [T, K] of every MoE layer, from forward hooks on the routers."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, o, pick=pick: seen.append(o[pick].reshape(B * L, -1)))
             for r, pick in routers(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return [s.sort(-1).values for s in seen]


def _hf_routers(model):
    return [(layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate, 2)
            for layer in model.model.layers if hasattr(layer.mlp, "router") or hasattr(layer.mlp, "experts")]


def _our_routers(model):
    return [(moe.router, 1) for moe in model.moe_layers()]


def _grads_as_hf(h, family, model, hf_config) -> dict[str, torch.Tensor]:
    """moelab's gradients under transformers' in-memory parameter names."""
    params = dict(model.named_parameters(remove_duplicate=False))
    state = {k: (params[k].grad if k in params and params[k].grad is not None else torch.zeros_like(v))
             for k, v in model.state_dict().items()}
    return h.hf_memory_layout(family, adapter_for(hf_config).state_dict_to_hf(hf_config, model.cfg, state))


def _ids(pad_id=None, inside=False):
    ids = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))
    if pad_id is not None:  # right padding of different lengths, and (inside) one pad id inside the text
        ids = ids % (V - 1)
        ids[ids >= pad_id] += 1  # the text holds no pad id by chance
        ids[0, L - 3:], ids[1, L - 5:] = pad_id, pad_id
        if inside:
            ids[1, 2] = pad_id
    return ids


def _compare(h, family, tmp_path, changes, aux=False, pad_id=None, step=True):
    """Everything the module docstring lists, for one config."""
    if pad_id is not None:
        changes = {**changes, "pad_token_id": pad_id}
    if aux:
        changes = {**changes, "router_aux_loss_coef": 0.37}
    ref = h.build(family, **changes)
    ref.save_pretrained(tmp_path / "in")
    ours = load_hf(tmp_path / "in") if aux else load_hf(tmp_path / "in", **{"model.moe.aux_loss_coeff": 0.0})
    # transformers' aux loss leaves out what its attention mask masks, which also hides those keys from attention
    # (moelab masks no keys): a pad inside the text is tried without the aux loss only
    ids = _ids(pad_id, inside=not aux)
    # logits and the top-k sets (eval mode)
    with torch.no_grad():
        ref_logits = ref(ids).logits
        h.close(ours(ids), ref_logits, "logits")
    assert ref_logits.abs().max() > 1.0  # the comparison above means something
    for i, (a, b) in enumerate(zip(_topk_sets(ours, _our_routers, ids), _topk_sets(ref, _hf_routers, ids),
                                   strict=True)):
        assert torch.equal(a, b), f"MoE layer {i}: top-k sets differ for {int((a != b).any(-1).sum())} tokens"
    # gradients of CE (+ aux): targets at the pad id (or -100) count nowhere
    ref.train(), ours.train()
    labels = ids if pad_id is None else ids.masked_fill(ids == pad_id, IGNORE_INDEX)
    mask = None if pad_id is None else torch.cat([labels[:, 1:] != IGNORE_INDEX, torch.zeros(B, 1, dtype=bool)], 1)
    out = ref(ids, labels=labels, attention_mask=mask.long() if aux and mask is not None else None,
              output_router_logits=aux)
    out.loss.backward()
    targets = torch.cat([ids[:, 1:], torch.full((B, 1), IGNORE_INDEX)], 1)
    for moe in ours.moe_layers():
        moe.router.token_mask = loss_mask(targets, ours.cfg.pad_token_id)
    loss = cross_entropy(ours(ids), targets, pad_token_id=ours.cfg.pad_token_id)
    h.close(loss, out.loss - (0.37 * out.aux_loss if aux else 0.0), "cross entropy")
    loss.backward()
    grads = _grads_as_hf(h, family, ours, ours.hf_config)
    for name, p in ref.named_parameters():
        if p.numel():  # DeepSeek-V3 with n_shared_experts=0 holds shared experts of width 0
            h.close(grads[name], p.grad, f"gradient of {name}")
    if pad_id is not None:
        assert not ours.tok_embeddings.weight.grad[pad_id].any()
    if not step:
        return ref, ours
    # one optimizer step on both, then logits and the round trip
    for model in (ref, ours):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        model.eval()
    with torch.no_grad():
        ref_logits = ref(ids).logits
        h.close(ours(ids), ref_logits, "logits after a step")
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        h.close(back(ids).logits, ref_logits, "logits after save_hf -> from_pretrained")
    return ref, ours


# ---------------------------------------------------------------------------------------------- fixed cases
CASES = {
    "qwen3_moe": [
        dict(num_experts_per_tok=1, norm_topk_prob=True),  # issue 16.1
        dict(num_experts_per_tok=3, norm_topk_prob=False, tie_word_embeddings=True, attention_bias=True),
        dict(hidden_act="gelu", mlp_only_layers=[0, 1], use_sliding_window=True, sliding_window=5),
        dict(hidden_act="relu", decoder_sparse_step=3, mlp_only_layers=[],  # layers 0 and 1 dense
             rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "beta_slow": 2.0,
                              "truncate": False, "original_max_position_embeddings": 8}),  # yarn's ramp reversed
    ],
    "deepseek_v3": [
        dict(num_experts_per_tok=1, norm_topk_prob=True, n_group=1, topk_group=1),  # issue 16.1
        dict(q_lora_rank=None, n_shared_experts=0, first_k_dense_replace=0, n_group=2, topk_group=1,
             routed_scaling_factor=1.0, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh"),
        dict(n_shared_experts=2, first_k_dense_replace=2, num_experts_per_tok=4, attention_bias=True,
             norm_topk_prob=False, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 5e3}),
    ],
    "gpt_oss": [
        dict(attention_bias=False),  # issue 16.6
        dict(num_experts_per_tok=1, tie_word_embeddings=True, sliding_window=3),
        dict(num_experts_per_tok=3, layer_types=["sliding_attention", "sliding_attention"], sliding_window=6),
    ],
}


@pytest.mark.parametrize("family,changes", [(f, c) for f, cs in CASES.items() for c in cs],
                         ids=[f"{f}-{i}" for f, cs in CASES.items() for i in range(len(cs))])
def test_matches_transformers(family, changes, tmp_path, hfm):
    _compare(hfm, family, tmp_path, changes)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_ce_plus_aux_gradients_match_for_one_moe_layer(family, tmp_path, hfm):
    """load_hf maps router_aux_loss_coef to K times it (moelab counts over T*K, transformers over T): with one
    MoE layer, CE + aux and every gradient equal transformers' (output_router_logits=True)."""
    one_moe = {"num_hidden_layers": 2, "mlp_only_layers": [0]} if family == "qwen3_moe" else {"num_hidden_layers": 1}
    _, ours = _compare(hfm, family, tmp_path, {**one_moe, "num_experts_per_tok": 3}, aux=True)
    assert ours.cfg.moe.aux_loss_coeff == pytest.approx(3 * 0.37)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["router_aux_loss_coef"] == pytest.approx(0.37)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_padding_is_left_out_of_loss_aux_and_embedding_gradient(family, tmp_path, hfm):
    """pad_token_id: its embedding row gets no gradient, its targets count in neither the loss nor the aux loss
    (transformers given labels -100 and the attention mask of the targets that count)."""
    one_moe = ({"num_hidden_layers": 2, "mlp_only_layers": [0]} if family == "qwen3_moe"
               else {"num_hidden_layers": 2, "first_k_dense_replace": 1})
    _compare(hfm, family, tmp_path, one_moe, aux=family == "qwen3_moe", pad_id=5, step=False)


# ---------------------------------------------------------------------------------------------- hypothesis
def _rope(d, family):
    if family != "gpt_oss" and not d(st.booleans()):
        return {"rope_type": "default", "rope_theta": d(st.sampled_from([1e4, 5e5]))}
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": d(st.sampled_from([2.0, 8.0, 40.0])),
            "original_max_position_embeddings": d(st.sampled_from([8, 64])), "truncate": d(st.booleans()),
            "beta_fast": d(st.sampled_from([32.0, 16.0])), "beta_slow": d(st.sampled_from([1.0, 2.0]))}
    if family == "deepseek_v3" and d(st.booleans()):
        rope.update(mscale=d(st.sampled_from([0.707, 1.0])), mscale_all_dim=d(st.sampled_from([0.707, 1.0])))
    return rope


def _draw(family, d):
    top_k = d(st.integers(1, 4))
    c = {"num_experts_per_tok": top_k, "tie_word_embeddings": d(st.booleans()),
         "attention_bias": d(st.booleans()), "rope_parameters": _rope(d, family)}
    if family == "qwen3_moe":
        c.update(norm_topk_prob=d(st.booleans()), mlp_only_layers=list(range(d(st.integers(0, 2)))),
                 hidden_act=d(st.sampled_from(["silu", "gelu", "gelu_new", "relu"])))
        if d(st.booleans()):
            c.update(use_sliding_window=True, sliding_window=d(st.integers(2, L - 1)))
    elif family == "deepseek_v3":
        groups = d(st.sampled_from([1, 2, 4]))
        c.update(n_group=groups, topk_group=d(st.integers(1, groups)), norm_topk_prob=d(st.booleans()),
                 routed_scaling_factor=d(st.sampled_from([1.0, 2.5])), first_k_dense_replace=d(st.integers(0, 2)),
                 n_shared_experts=d(st.integers(0, 2)), q_lora_rank=d(st.sampled_from([None, 24])))
        if top_k > 8 // groups * c["topk_group"]:
            c["num_experts_per_tok"] = 8 // groups * c["topk_group"]
        c["rope_interleave"] = d(st.booleans())
    else:
        c.update(sliding_window=d(st.integers(2, L - 1)),
                 layer_types=d(st.sampled_from([None, ["sliding_attention"] * 2, ["full_attention"] * 2])))
    return c


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data(), family=st.sampled_from(["qwen3_moe", "deepseek_v3", "gpt_oss"]))
def test_random_configs_match_transformers(data, family, tmp_path_factory, hfm):
    changes = _draw(family, data.draw)
    _compare(hfm, family, tmp_path_factory.mktemp(family), changes)
