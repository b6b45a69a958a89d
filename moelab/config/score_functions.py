"""Router score functions: how a router turns its logits into expert scores, which scores its top-k is taken from,
and how the chosen experts are weighed. One object per function, in one registry that `model.moe.score_func`
names: the config rules ask it which names exist and which can route group-limited, the router computes with it
(moelab.model.router), and each HF family adapter names the one its format computes (moelab.hf.adapter).

    class Squared(ScoreFunction):
        '''relu(logit)^2 as the score, normalised over the chosen experts.'''
        name = "squared"

        def scores(self, logits_TE):
            return logits_TE.relu().square()

    register_score_function(Squared())
    load_config("tiny", ["model.moe.score_func=squared"])   # validated; a model built from it routes with it

Written with tensor methods only, so that this module (on the config layer, below the model) imports no torch.
Shapes: T tokens, E experts, K top-k.
"""
from __future__ import annotations

from typing import Any


class ScoreFunction:
    """One score function. A subclass gives `name` and `scores`; the defaults select the top-k of the scores and
    weigh the chosen experts by their scores (renormalised over the k with model.moe.norm_topk_prob, times
    model.moe.route_scale), and the aux loss sees the scores as they are.

        SCORE_FUNCTIONS["sigmoid"].scores(logits_TE)      # logits_TE.sigmoid()
    """

    name: str = ""
    group_limited: bool = True  # can it route group-limited (model.moe.num_groups > 1)?

    def scores(self, logits_TE: Any) -> Any:
        """fp32 scores_TE from fp32 logits_TE: what the statistics and the aux loss see."""
        raise NotImplementedError

    def selection(self, logits_TE: Any, scores_TE: Any) -> Any:
        """What the top-k is taken of (the router adds the expert bias and any group limits)."""
        return scores_TE

    def weights(self, logits_TE: Any, scores_TE: Any, experts_TK: Any, moe) -> Any:
        """The chosen experts' combine weights_TK (`moe`: the MoEConfig)."""
        weights_TK = scores_TE.gather(1, experts_TK)
        if moe.norm_topk_prob:  # top_k = 1 too: the weight becomes 1 (times route_scale), as in HF
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        return weights_TK * moe.route_scale

    def aux_probs(self, scores_TE: Any) -> Any:
        """The per-expert probabilities the load-balancing loss averages (each token's summing to 1)."""
        return scores_TE

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Softmax(ScoreFunction):
    """Softmax over all experts (Qwen3-MoE, Mixtral): select and weigh by it.

        Softmax().scores(logits_TE)     # logits_TE.softmax(-1)
    """

    name = "softmax"

    def scores(self, logits_TE):
        """Softmax of the logits over the experts."""
        return logits_TE.softmax(-1)


class Sigmoid(ScoreFunction):
    """An independent sigmoid per expert (DeepSeek-V3); the aux loss sees them normalised per token.

        Sigmoid().aux_probs(scores_TE)  # scores_TE / scores_TE.sum(-1, keepdim=True)
    """

    name = "sigmoid"

    def scores(self, logits_TE):
        """Sigmoid of each logit, independently per expert."""
        return logits_TE.sigmoid()

    def aux_probs(self, scores_TE):
        """The sigmoid scores normalised to sum to 1 per token."""
        return scores_TE / scores_TE.sum(-1, keepdim=True)


class SoftmaxTopk(Softmax):
    """GPT-OSS: choose by logit, weigh by a softmax over the chosen k (times route_scale); the statistics and the
    aux loss see the softmax over all experts. No group-limited routing.

        SoftmaxTopk().selection(logits_TE, scores_TE) is logits_TE   # True
    """

    name = "softmax_topk"
    group_limited = False

    def selection(self, logits_TE, scores_TE):
        """The raw logits: the top-k is chosen by logit."""
        return logits_TE

    def weights(self, logits_TE, scores_TE, experts_TK, moe):
        """Softmax over the chosen experts' logits, times model.moe.route_scale."""
        return logits_TE.gather(1, experts_TK).softmax(-1) * moe.route_scale


SCORE_FUNCTIONS: dict[str, ScoreFunction] = {f.name: f for f in (Softmax(), Sigmoid(), SoftmaxTopk())}
BUILT_IN = frozenset(SCORE_FUNCTIONS)


def register_score_function(fn: ScoreFunction) -> ScoreFunction:
    """Make `fn` available as model.moe.score_func=fn.name (registering a name again replaces it, so a notebook
    cell can run twice; the built-in ones stay). Returns fn."""
    if not isinstance(fn, ScoreFunction) or not isinstance(fn.name, str) or not fn.name:
        raise TypeError(f"register_score_function({fn!r}): give a ScoreFunction instance with a non-empty name")
    if fn.name in BUILT_IN and SCORE_FUNCTIONS[fn.name] is not fn:
        raise ValueError(f"score function {fn.name!r} is built in; register yours under another name")
    SCORE_FUNCTIONS[fn.name] = fn
    return fn


def unregister_score_function(name: str) -> None:
    """Forget a registered score function (not a built-in one); an unknown name is ignored."""
    if name in BUILT_IN:
        raise ValueError(f"score function {name!r} is built in and stays registered")
    SCORE_FUNCTIONS.pop(name, None)
