"""A router score function is one object in one registry (moelab.config.score_functions): a new one is a class and a
registration, here in the test itself, and the config rules, the router, the trainer and the HF export follow."""
import pytest
import torch

from moelab.config import ConfigError, load_config
from moelab.config.score_functions import (SCORE_FUNCTIONS, ScoreFunction, register_score_function,
                                           unregister_score_function)
from moelab.contract.stream import read_events
from moelab.model.assemble import assemble
from moelab.train.trainer import Trainer


class Softplus(ScoreFunction):
    """log(1 + e^logit) per expert: positive, independent scores; the aux loss sees them normalised per token."""

    name = "toy_softplus"
    group_limited = False

    def scores(self, logits_TE):
        return logits_TE.exp().log1p()

    def aux_probs(self, scores_TE):
        return scores_TE / scores_TE.sum(-1, keepdim=True)


@pytest.fixture
def toy():
    fn = register_score_function(Softplus())  # the one registration
    yield fn
    unregister_score_function(fn.name)


def test_the_config_rules_ask_the_registry(toy):
    cfg = load_config("tiny", {"model.moe.score_func": toy.name})
    assert cfg.model.moe.score_func == toy.name
    with pytest.raises(ConfigError, match="model.moe.num_groups=2: model.moe.score_func='toy_softplus' cannot "
                                          "route group-limited"):
        load_config("tiny", {"model.moe.score_func": toy.name, "model.moe.num_groups": 2})
    unregister_score_function(toy.name)
    with pytest.raises(ConfigError, match=r"model.moe.score_func='toy_softplus': choose one of \['sigmoid', "
                                          r"'softmax', 'softmax_topk'\].*register_score_function"):
        load_config("tiny", {"model.moe.score_func": toy.name})


def test_the_router_of_a_built_model_weighs_with_the_toy(toy):
    cfg = load_config("tiny", {"model.moe.score_func": toy.name, "model.moe.norm_topk_prob": True})
    router = assemble(cfg, "random").moe_layers()[0].router
    assert router.score is toy
    x_BLD = torch.randn(2, 5, cfg.model.hidden_size)
    weights_TK, experts_TK, _, _ = router(x_BLD)
    scores_TE = torch.nn.functional.softplus(x_BLD.reshape(10, -1) @ router.weight.t())
    expected_TK = scores_TE.topk(cfg.model.moe.top_k).indices
    w_TK = scores_TE.gather(1, expected_TK)
    # the same choices; the weights up to softplus' own formula against exp().log1p() (a few fp32 ulps)
    assert torch.equal(experts_TK.sort(-1).values, expected_TK.sort(-1).values)
    torch.testing.assert_close(weights_TK.sort(-1).values, (w_TK / w_TK.sum(-1, keepdim=True)).sort(-1).values,
                               rtol=1e-5, atol=1e-6)


def test_a_tiny_run_trains_with_the_toy_and_saving_it_as_hf_is_refused(toy, tmp_path):
    cfg = load_config("tiny", {"model.moe.score_func": toy.name, "model.num_layers": 2, "train.steps": 2,
                               "train.seq_len": 16, "train.global_batch_size": 2, "train.micro_batch_size": 2,
                               "train.device": "cpu", "train.warmup_steps": 1, "train.save_checkpoints": False})
    Trainer(cfg, tmp_path / "run").run()
    steps = [e for e in read_events(tmp_path / "run" / "metrics.jsonl") if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2] and all(torch.isfinite(torch.tensor(e["loss"])) for e in steps)
    from moelab.hf.qwen3_moe import Qwen3MoeAdapter

    with pytest.raises(ConfigError, match="routes with score_func='softmax'.*model.moe.score_func='toy_softplus'"):
        Qwen3MoeAdapter().config_to_hf(cfg.model)


def test_the_built_in_ones_stay():
    with pytest.raises(ValueError, match="built in"):
        register_score_function(type("Mine", (ScoreFunction,), {"name": "softmax"})())
    with pytest.raises(ValueError, match="built in"):
        unregister_score_function("sigmoid")
    assert sorted(SCORE_FUNCTIONS) == ["sigmoid", "softmax", "softmax_topk"]
