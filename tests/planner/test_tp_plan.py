"""Tensor parallelism in the planner (issue 40): a published TP layout plans; a TP rank holds a tp-th of the dense
weights and of the sequence-parallel activations (the gathered inputs whole), a tp-th of the logits; its
collectives are the per-block all-gathers and reduce-scatters of the micro batch's hidden states; the validator's
divisibility rules name the field."""
import pytest

from moelab.config import ConfigError, load_config
from moelab.planner.plan import plan, tp_collectives_per_layer, tp_gathered_per_token
from moelab.planner.saved import saved_per_token

DSV3_TP = {"parallel.tp": 2, "parallel.pp": 8, "parallel.vp": 4, "parallel.ep": 64, "parallel.fsdp": -1}
PROXY = "qwen3-moe-30b-a3b-proxy"
BF16 = {"train.dtype": "bfloat16", "train.param_dtype": "bfloat16", "train.global_batch_size": 4,
        "train.activation_checkpointing": "none"}


def test_the_published_deepseek_v3_tp_layout_plans_with_its_collectives():
    p = plan(load_config("deepseek-v3", DSV3_TP), gpus=1024, gpu="h100")
    assert p.layout["tp"] == 2 and p.layout["fsdp"] == 64 and p.fits
    s = p.speed
    assert s.parts_s["tp"] > 0 and s.step_s == pytest.approx(sum(s.parts_s.values()))
    assert any(a.startswith("TP 2 with sequence parallelism") for a in p.assumptions)


def _pair(**over):
    """The proxy on 4 GPUs as tp=2 x fsdp=2 and as fsdp=4: the same ranks share each dense weight."""
    full = {"backend.loss": "full"}  # what TP runs (the loss on vocabulary-sharded logits), for both
    tp = plan(load_config(PROXY, {**BF16, **full, "parallel.tp": 2, "parallel.fsdp": 2, **over}), gpus=4)
    dp = plan(load_config(PROXY, {**BF16, **full, "parallel.fsdp": 4, "train.global_batch_size": 8, **over}), gpus=4)
    return tp, dp


def test_tp_splits_dense_weights_gathered_blocks_activations_and_logits():
    tp, dp = _pair()
    # each rank holds a quarter of every dense weight either way (norms and router counted split: < 0.1%)
    assert tp.memory["parameters"] == pytest.approx(dp.memory["parameters"], rel=1e-3)
    # with the experts on their own mesh (ep=2), FSDP2 gathers each dense unit's TP half over fsdp*cp ranks: the
    # biggest block (its dense half and its experts) twice in bf16 and once in fp32 (moelab.planner.gathered)
    tp_ep, dp_ep = _pair(**{"parallel.ep": 2})
    units = {u["name"]: u for u in dp_ep.comm["fsdp_units"]}
    halves = {u["name"]: u for u in tp_ep.comm["fsdp_units"]}
    # ... but the router, which every TP rank holds whole, in a unit of its own over the fsdp*cp*tp ranks
    router = halves["moe layers"]["params"]
    assert router == 2048 * 128 and halves["moe layers"]["ranks"] == 4
    assert halves["blocks"]["params"] + router // 2 == units["blocks"]["params"] // 2
    assert halves["blocks"]["ranks"] == 2
    assert halves["root"]["params"] == units["root"]["params"] // 2
    assert halves["experts"] == units["experts"]  # EP's, whole
    biggest = halves["blocks"]["params"] + router + halves["experts"]["params"]
    assert tp_ep.memory["gathered_params"] == (2 * 2 + 4) * biggest < dp_ep.memory["gathered_params"]
    # the loss on vocabulary-sharded logits holds a tp-th of what the sharded-free torch loss holds (the code
    # before the in-place kernel); without TP that kernel writes the gradient over the logits: one bf16 buffer
    torch_loss = plan(load_config(PROXY, {**BF16, "backend.loss": "full", "parallel.fsdp": 4,
                                          "train.global_batch_size": 8}), gpus=4, full_loss="compiled")
    assert tp.memory["logits"] == pytest.approx(torch_loss.memory["logits"] / 2, rel=1e-3)
    assert dp.memory["logits"] == 2 * 4096 * load_config(PROXY).model.vocab_size * 2
    # the same micro batch (2 x 4096 tokens) a tp-th per rank, the gathered input of attention whole (the MoE
    # layers route their sequence shard: moelab.parallel.tensor)
    cfg = load_config(PROXY, BF16)
    per_tok = sum(saved_per_token(cfg, True, 2).values()) - saved_per_token(cfg, True, 2)["input"]
    T, layers = 2 * 4096, cfg.model.num_layers
    assert cfg.model.num_dense_layers == 0
    assert tp.activations_per_micro_batch["none"] == pytest.approx(
        layers * (T / 2 * per_tok + T / 2 * 1 * tp_gathered_per_token(cfg, 2)) + T / 2 * 2048 * (4 + 4), rel=1e-6)


def test_tp_collectives_are_counted_per_block_and_micro_batch():
    tp, _ = _pair()
    c, T, D = tp.comm, 2 * 4096, 2048
    assert c["tp_bytes_per_collective"] == T * D * 2 // 2  # (tp - 1) / tp of the micro batch's hidden states
    m, layers = tp.micro_batches_per_step, 8
    # attention's 4 per MoE block (the MoE layer routes its sequence shard), + embedding and head on the one stage
    assert c["tp_collectives_per_step"] == m * (layers * 4 + 2 + 2)
    full = plan(load_config(PROXY, {**BF16, "parallel.tp": 2, "parallel.fsdp": 2,
                                    "train.activation_checkpointing": "full"}), gpus=4).comm
    assert tp_collectives_per_layer("full", 1) == 6 and full["tp_collectives_per_step"] == m * (layers * 6 + 4)
    assert tp_collectives_per_layer("none") == 8  # a dense block: attention and its MLP
    assert tp_collectives_per_layer("full") == 11  # the rerun stops before the MLP's reduce-scatter
    assert plan(load_config(PROXY, BF16), gpus=1).comm["tp_bytes_per_step"] == 0


def test_tp_routes_the_sequence_shard_through_the_experts():
    tp, dp = _pair(**{"parallel.ep": 2})
    # a rank dispatches its sequence shard: half the micro batch's tokens
    assert tp.comm["all_to_all_bytes_per_moe_layer"] == pytest.approx(dp.comm["all_to_all_bytes_per_moe_layer"] / 2,
                                                                      rel=1e-6)


def test_tp_that_does_not_divide_the_heads_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="parallel.tp=3: must divide model.num_heads's 32"):
        plan(load_config(PROXY, {"parallel.tp": 3}), gpus=3)
    with pytest.raises(ConfigError, match="parallel.tp=8: must divide model.num_kv_heads's 4"):
        plan(load_config(PROXY, {"parallel.tp": 8}), gpus=8)
