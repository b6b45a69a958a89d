"""The MoE feed-forward: route, dispatch to experts, compute, combine, add shared experts.

Shapes: B batch, L sequence, T tokens (B*L), D hidden, K top-k, E experts, N routed rows (T*K).

The layer holds no parallelism. Moving rows to the experts is the job of ``self.dispatcher``: the default
``LocalDispatcher`` only sorts rows by expert; moelab.parallel swaps in an all-to-all dispatcher for expert
parallelism (and the backend switchboard may swap in DeepEP) without touching this module.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from moelab.config import BackendConfig, MoEConfig
from moelab.model.batch_context import NO_CONTEXT, BatchContext
from moelab.model.experts import GroupedExperts
from moelab.model.layers import SwiGLU
from moelab.model.rows import combine_rows, dispatch_rows, inverse_permutation
from moelab.model.router import Router, count_ids


def _call(module, *args):
    return module(*args)


class AttachLoss(torch.autograd.Function):
    """Identity on `x` whose backward also sends gradient `scale` into `loss`.

    This lets router losses train without being returned through every layer (and through pipeline stages):
    the trainer passes the weight of one micro batch in the step's loss (BatchContext.loss_scale).

        y_BLD = AttachLoss.apply(y_BLD, aux_loss, scale)   # y unchanged; backward adds d(scale * loss)
    """

    @staticmethod
    def forward(ctx, x, loss, scale: float):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        (loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(loss, ctx.scale), None


class Dispatcher:
    """How a MoE layer's rows reach its experts and come back. ``route`` runs dispatch -> experts -> combine
    in order; a dispatcher may override it to overlap its communication with the experts' compute
    (moelab.parallel.expert_parallel.OverlappedAllToAllDispatcher), giving the same result.

    Where the routing weights are applied is decided here, once: a dispatcher whose ``row_weights`` gives each
    dispatched row its weight hands them to the experts, which scale each row's activation before the down
    projection (the combine then only sums: autograd keeps no expert output for the weights' gradient); one whose
    ``row_weights`` is None (the default: expert parallelism, where the rows come from other ranks and the
    weights stay on theirs) weights the returned rows at combine.

        y_TD = LocalDispatcher().route(experts, x_TD, weights_TK, experts_TK, keep_TK, num_experts)

    ``exchanges``: whether the dispatch communicates (expert parallelism), so that selective recompute keeps
    what it delivered instead of running it again (moelab.model.recompute).
    """

    exchanges = False

    def route(self, experts, x_TD, weights_TK, experts_TK, keep_TK, num_experts):
        x_ND, counts, ctx = self.dispatch(x_TD, experts_TK, keep_TK, num_experts)
        scale_N = self.row_weights(weights_TK, keep_TK, ctx, counts)
        y_ND = experts(x_ND, counts) if scale_N is None else experts(x_ND, counts, scale_N)
        return self.combine(y_ND, ctx, weights_TK, keep_TK, counts)

    def row_weights(self, weights_TK, keep_TK, ctx, counts):
        """The dispatched rows' routing weights for the experts ([N], in the router's dtype: fp32 under autocast),
        or None: combine applies them."""
        return None


def _computed_rows(rows_N: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows the grouped GEMM computes, those before counts_E's sum (dropped assignments sort last)."""
    return torch.arange(rows_N.shape[0], device=rows_N.device) < counts_E.sum()


class LocalDispatcher(Dispatcher):
    """All experts on this rank: sort the N = T*K assignments by expert, and undo it after. The experts weight
    their rows (``row_weights``); combine unsorts and sums each token's K rows.

        x_ND, counts_E, (order_N, inverse_N) = LocalDispatcher().dispatch(x_TD, experts_TK, keep_TK, num_experts)

    The rows move by gathers both ways (moelab.model.rows: no scatter-add in either gradient). Experts whose
    ``impl`` is "triton_fused" (moelab.model.fused_experts) or "sonic" (moelab.backends.sonic) take the tokens and
    the weights instead (triton_fused also the dispatch order; SonicMoE builds its own from each token's experts),
    reading and writing each token's rows inside their GEMMs; every assignment kept (the switchboard refuses those
    backends with capacity drops).
    """

    def route(self, experts, x_TD, weights_TK, experts_TK, keep_TK, num_experts):
        impl = getattr(experts, "impl", None)
        if keep_TK is None and impl == "sonic":  # SonicMoE builds its own routing metadata from experts_TK
            return experts.on_tokens(x_TD, weights_TK, None, None, experts_TK)
        if keep_TK is None and impl == "triton_fused":
            flat_N = experts_TK.reshape(-1)
            return experts.on_tokens(x_TD, weights_TK, torch.argsort(flat_N, stable=True),
                                     count_ids(flat_N, num_experts), experts_TK)
        return super().route(experts, x_TD, weights_TK, experts_TK, keep_TK, num_experts)

    def dispatch(self, x_TD, experts_TK, keep_TK, num_experts):
        T, K = experts_TK.shape
        flat_N = experts_TK.reshape(-1)
        if keep_TK is not None:  # dropped assignments sort last, behind a sentinel expert
            flat_N = torch.where(keep_TK.reshape(-1), flat_N, num_experts)
        order_N = torch.argsort(flat_N, stable=True)
        inverse_N = inverse_permutation(order_N)
        counts_E = count_ids(flat_N, num_experts + 1)[:num_experts]  # on the device: no host sync
        x_ND = dispatch_rows(x_TD, order_N, inverse_N, K)
        if keep_TK is not None:
            # The grouped GEMM leaves the rows past the kept ones undefined in its output AND in its input
            # gradient; masking them here keeps that garbage out of the dropped tokens' gradients.
            x_ND = torch.where(_computed_rows(x_ND, counts_E)[:, None], x_ND, 0.0)
        return x_ND, counts_E, (order_N, inverse_N)

    def row_weights(self, weights_TK, keep_TK, ctx, counts_E):
        """weights_TK in dispatch order. Rows past the kept ones (dropped assignments) get 0, selected rather than
        multiplied, so that the undefined values the grouped GEMM leaves there send no NaN into the weights'
        gradient."""
        w_N = weights_TK.reshape(-1)[ctx[0]]
        return w_N if keep_TK is None else torch.where(_computed_rows(w_N, counts_E), w_N, 0.0)

    def combine(self, y_ND, ctx, weights_TK, keep_TK, counts_E):
        """y_ND: the experts' rows, already weighted (row_weights); only weights_TK's shape and dtype are read:
        the sum over K is in the dtype a weighted combine returns (EP's: fp32 for fp32 weights)."""
        K = weights_TK.shape[1]
        if keep_TK is not None:  # rows past the kept ones were not computed by the grouped GEMM
            y_ND = torch.where(_computed_rows(y_ND, counts_E)[:, None], y_ND, 0.0)
        return combine_rows(y_ND, *ctx, K, torch.promote_types(y_ND.dtype, weights_TK.dtype))


class MoE(nn.Module):
    """A MoE FFN: router -> dispatch (local, or all-to-all under EP) -> grouped experts -> combine, plus shared
    experts; the router's losses are attached to the output for backward.

        moe = MoE(64, load_config("tiny").model.moe, BackendConfig())
        y_BLD = moe(x_BLD)
    """
    def __init__(self, dim: int, cfg: MoEConfig, backend: BackendConfig, act: str = "silu"):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.router = Router.from_config(dim, cfg, backend)
        # act (ModelConfig.hidden_act) is the gate's activation; "swiglu" experts with another one take its name
        activation = cfg.activation if cfg.activation == "gpt_oss" or act in ("silu", "swish") else act
        self.experts = GroupedExperts(cfg.num_experts, dim, cfg.expert_ffn_size,
                                      backend.experts if backend.experts in ("auto", "grouped_mm", "loop") else "auto",
                                      bias=cfg.expert_proj_bias, activation=activation)
        self.shared_experts = (SwiGLU(dim, cfg.expert_ffn_size * cfg.num_shared_experts, act)
                               if cfg.num_shared_experts else None)
        self.dispatcher = LocalDispatcher()

    def forward(self, x_BLD: torch.Tensor, ctx: BatchContext = NO_CONTEXT, record: dict | None = None,
                routed=None) -> torch.Tensor:
        """`record`: a dict that takes the router's statistics instead of its buffers (Router.forward).
        `routed(moe, x_BLD, route, loss_scale)`: runs everything after the router in place of ``self.routed``
        (selective recompute: moelab.model.recompute), so that both stay inside this module's call."""
        route = self.router(x_BLD, ctx.token_mask_BL, record)
        if routed is None:
            return self.routed(x_BLD, *route, loss_scale=ctx.loss_scale)
        return routed(self, x_BLD, route, ctx.loss_scale)

    def routed(self, x_BLD, weights_TK, experts_TK, keep_TK, router_loss, loss_scale: float = 1.0,
               run=None) -> torch.Tensor:
        """Everything after the router: dispatch, experts, combine, shared experts (selective recompute reruns
        this part, or only its experts, in backward with the router's outputs kept: moelab.model.recompute).
        `loss_scale`: the weight of this micro batch's router losses in the step's loss
        (BatchContext.loss_scale). `run(module, *args)` calls the routed and shared experts (default: plainly)."""
        run = run or _call
        B, L, D = x_BLD.shape
        x_TD = x_BLD.reshape(B * L, D)
        if keep_TK is not None:
            weights_TK = weights_TK * keep_TK
        # the module itself when called plainly: the local dispatcher hands the tokens to an on-tokens backend
        # (GroupedExperts.on_tokens) by the module's impl, which a wrapped call would hide
        experts = self.experts if run is _call else functools.partial(run, self.experts)
        y_TD = self.dispatcher.route(experts, x_TD, weights_TK, experts_TK, keep_TK, self.num_experts)
        if self.shared_experts is not None:
            y_TD = y_TD + run(self.shared_experts, x_TD)
        y_BLD = y_TD.view(B, L, D)
        if router_loss.requires_grad:
            y_BLD = AttachLoss.apply(y_BLD, router_loss, loss_scale)
        return y_BLD
