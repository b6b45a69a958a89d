"""Token-choice top-k router with the load-balancing strategies used in practice.

Shapes: B batch, L sequence, T tokens (B*L), D hidden, E experts, K top-k, P expert groups, X experts per group
(docs/shapes.md).

Routing statistics are accumulated in buffers on the device (no host synchronisation); the trainer reads and
resets them once per optimizer step (``pop_stats``). The expert bias only changes which experts are selected,
never the combine weights, and is updated after the optimizer step (``update_bias``). A forward given a `record`
dict puts its statistics there instead, so that a forward recomputed in backward counts nothing twice
(moelab.model.recompute adds what the real forward recorded, once: ``add_record``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelab.config import BackendConfig, MoEConfig
from moelab.config.rules import check_score_func
from moelab.config.score_functions import SCORE_FUNCTIONS

# The router's per-step statistics, named once: the stat_<name> buffers, pop_stats' keys and what the trainer
# sums over ranks (moelab.train.trainer) all iterate these. Counts are summed over a step's calls and the ranks;
# the others are averaged over the step's calls (the ranks weighted: Parallelized.stat_weight). pop_stats adds
# capacity_factor, the factor in force (a buffer of its own, averaged like the others).
SUMMED_STATS = ("tokens_per_expert", "routed_per_expert", "dropped")
AVERAGED_STATS = ("aux_loss", "z_loss", "entropy", "logit_norm")
PER_EXPERT_STATS = ("tokens_per_expert", "routed_per_expert")  # E values per layer (the others: one)
ROUTER_STATS = SUMMED_STATS + AVERAGED_STATS + ("capacity_factor",)  # pop_stats' keys, in this order


def count_ids(idx_N: torch.Tensor, n: int, weights_N: torch.Tensor | None = None) -> torch.Tensor:
    """torch.bincount(idx_N, weights_N, minlength=n) for ids in [0, n), counted on the device: bincount sizes its
    output from idx.max(), a device-to-host read on CUDA (a synchronisation per call, and a break in the
    compiled graph); a scatter-add into n slots needs neither. Unweighted counts are int64 (as bincount's);
    weighted ones float32, exact for whole-number weights (the 0/1 padding masks here).

        count_ids(torch.tensor([0, 2, 2]), 4)  # tensor([1, 0, 2, 0])
    """
    if weights_N is None:
        zeros = torch.zeros(n, dtype=torch.int64, device=idx_N.device)
        return zeros.scatter_add_(0, idx_N, torch.ones_like(idx_N))
    w_N = weights_N.float()
    return torch.zeros(n, dtype=w_N.dtype, device=idx_N.device).scatter_add_(0, idx_N, w_N)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 from bf16 operands: on CUDA a tensor-core GEMM writing fp32 (torch.mm's out_dtype), else the
    operands upcast first (the same values: products of bf16 numbers are exact in fp32)."""
    return torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float()


def _split_bf16(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 g as hi + lo in bf16: hi = g with its low 16 bits cleared (exact in bf16), lo = g - hi (exact in fp32,
    rounded once): 16 significant bits, relative error about 2**-16. Bits are cleared, not rounded through bf16 and
    back: inductor may keep such a round trip in fp32, and lo would be zero."""
    hi = (g.contiguous().view(torch.int32) & -65536).view(torch.float32)
    return hi.to(torch.bfloat16), (g - hi).to(torch.bfloat16)


def _grad_mm(g: torch.Tensor, b: torch.Tensor, split: bool) -> torch.Tensor:
    """g @ b for an fp32 gradient g and a bf16 b at about fp32 accuracy: `split` (CUDA) through two bf16 GEMMs of
    g's two bf16 terms (_split_bf16), else in fp32."""
    if not split:
        return g @ b.float()
    hi, lo = _split_bf16(g)
    return _mm_f32(hi, b) + _mm_f32(lo, b)


class _Bf16Logits(torch.autograd.Function):
    """fp32 logits x_TD @ w_ED^T of bf16 x and w that keeps x in bf16 for backward, not an fp32 copy. On CUDA the
    GEMMs run on tensor cores with fp32 accumulation and output (products of bf16 values are exact in fp32, so the
    logits are the fp32 matmul's up to summation order; an fp32 GEMM runs on CUDA cores: about 2.6 ms per
    8,192-token micro batch of the Qwen3 proxy's 8 routers, fwd + bwd); the fp32 logit gradient goes through them
    split in two bf16 terms (_grad_mm). On CPU: the fp32 matmuls of the upcast values, as F.linear on fp32 copies."""

    @staticmethod
    def forward(ctx, x_TD, w_ED):
        # each operand is kept only for the other's gradient (a frozen router keeps no input)
        ctx.save_for_backward(x_TD if ctx.needs_input_grad[1] else None, w_ED if ctx.needs_input_grad[0] else None)
        ctx.dtypes = x_TD.dtype, w_ED.dtype
        return _mm_f32(x_TD, w_ED.t())

    @staticmethod
    def backward(ctx, g_TE):
        x_TD, w_ED = ctx.saved_tensors
        split, (x_dtype, w_dtype) = g_TE.is_cuda, ctx.dtypes
        dx = _grad_mm(g_TE, w_ED, split).to(x_dtype) if ctx.needs_input_grad[0] else None
        dw = _grad_mm(g_TE.t(), x_TD, split).to(w_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor, b_E: torch.Tensor | None = None) -> torch.Tensor:
    """The router's fp32 logits x_TD @ w_ED^T (+ b_E): bf16 x and w through _Bf16Logits (x kept in bf16, tensor
    cores on CUDA), anything else upcast to fp32 first.

        logits_TE = router_logits(x_TD, router.weight, router.bias)
    """
    if x_TD.dtype == w_ED.dtype == torch.bfloat16:
        logits_TE = _Bf16Logits.apply(x_TD, w_ED)
        return logits_TE if b_E is None else logits_TE + b_E.float()
    return F.linear(x_TD.float(), w_ED.float(), None if b_E is None else b_E.float())


class Router(nn.Module):
    """Scores experts with the score function model.moe.score_func names (moelab.config.score_functions), picks
    each token's top-k (optionally group-limited and biased), weighs them, and keeps the step's routing
    statistics; in training its loss (aux + z) carries gradient.

        router = Router(64, MoEConfig(num_experts=8, top_k=2)); router.reset_buffers()
        weights_TK, experts_TK, keep_TK, loss = router(x_BLD)
    """

    @classmethod
    def from_config(cls, dim: int, cfg: MoEConfig, backend: BackendConfig) -> "Router":
        """The router a MoE layer of `cfg` holds: its score function from the registry, and the benchmark's fake
        balanced gate when backend.fake_balanced_gate asks for it (backend.fake_gate_noise)."""
        return cls(dim, cfg, backend.fake_balanced_gate, backend.fake_gate_noise)

    def __init__(self, dim: int, cfg: MoEConfig, fake_balanced_gate: bool = False, fake_gate_noise: float = 0.0):
        super().__init__()
        self.cfg = cfg
        check_score_func(cfg)  # a MoEConfig built without a Config: the config's own message
        self.score = SCORE_FUNCTIONS[cfg.score_func]
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.fake_balanced_gate, self.fake_gate_noise = fake_balanced_gate, fake_gate_noise
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, dim))
        # Means over the tokens of a batch that other ranks share (context parallelism sets an autograd-aware
        # mean over its ranks, moelab.parallel.context); None: this rank holds whole sequences.
        self.token_mean = None
        # The fake balanced gate's count of this call's tokens: None counts them 0..T-1 (B*L, whole sequences);
        # tensor parallelism, whose rank holds a share of each sequence, counts positions of the whole one
        # (moelab.parallel.tensor): token_index(B, L, device) -> [T] long.
        self.token_index = None
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None  # GPT-OSS: learned
        # fp32 always: the bias is compared against fp32 scores and moved by tiny steps.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        # Capacity factor in force (dynamic capacity moves it between steps); persistent so resumes match.
        self.register_buffer("capacity_factor", torch.tensor(float(cfg.capacity_factor)))
        self.register_buffer("load_history", torch.zeros(max(cfg.capacity_window, 1), cfg.num_experts))
        self.register_buffer("history_len", torch.zeros((), dtype=torch.long))
        # Per-step statistics (not saved): tokens per expert, dropped assignments, loss terms, logit norms.
        # (routed_per_expert: before dropping)
        for name in SUMMED_STATS + AVERAGED_STATS + ("calls",):
            shape = (cfg.num_experts,) if name in PER_EXPERT_STATS else ()
            self.register_buffer(f"stat_{name}", torch.zeros(shape), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Buffers start empty after `to_empty` (building on the meta device); give them their initial values."""
        for name, buf in self.named_buffers():
            buf.zero_()
        self.capacity_factor.fill_(float(self.cfg.capacity_factor))
        if self.cfg.init_bias_skew:  # a skewed router for routing experiments (MoEConfig.init_bias_skew)
            self.expert_bias.copy_(self.cfg.init_bias_skew * torch.linspace(1, -1, self.num_experts))

    def forward(self, x_BLD: torch.Tensor, token_mask_BL: torch.Tensor | None = None, record: dict | None = None):
        """Returns (weights_TK, experts_TK, keep_TK or None, loss) where loss (aux + z) carries gradient.
        `token_mask_BL`: bool, the tokens that count (moelab.backends.full_loss.loss_mask; None: every token); padding
        stays out of the aux and z losses and the statistics. The call's routing statistics are added to the
        step's, or put into `record` (detached tensors by name, for ``add_record``): then the call has no side
        effect."""
        B, L, D = x_BLD.shape
        x_TD = x_BLD.reshape(B * L, D)
        # Routing in fp32 even inside a bf16 autocast region: near-ties between experts decide the selection.
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = router_logits(x_TD, self.weight, self.bias)
        if self.fake_balanced_gate:
            experts_TK = self._balanced_assignment(x_TD, B, L)
            weights_TK = torch.full(experts_TK.shape, 1.0 / self.top_k, device=x_TD.device)
            scores_TE = torch.softmax(logits_TE, -1)
        else:
            scores_TE = self.score.scores(logits_TE)
            experts_TK = self._select(self.score.selection(logits_TE, scores_TE).detach() + self.expert_bias)
            weights_TK = self.score.weights(logits_TE, scores_TE, experts_TK, self.cfg)
        keep_TK = self._capacity_mask(experts_TK, weights_TK) if self.cfg.capacity_factor > 0 else None

        mask_T = token_mask_BL.reshape(-1) if token_mask_BL is not None else None
        loss = logits_TE.new_zeros(())
        stats = self._stats(experts_TK, keep_TK, scores_TE.detach(), logits_TE.detach(), mask_T)
        if self.cfg.aux_loss_coeff > 0 and self.training and not self.fake_balanced_gate:
            aux = self._aux_loss(scores_TE, experts_TK, B, L, mask_T)
            loss = loss + self.cfg.aux_loss_coeff * aux
            stats["aux_loss"] = aux.detach()
        if self.cfg.z_loss_coeff > 0 and self.training:
            z = _mean(torch.logsumexp(logits_TE, -1).pow(2), mask_T, self.token_mean)
            loss = loss + self.cfg.z_loss_coeff * z
            stats["z_loss"] = z.detach()
        if record is None:
            self.add_record(stats)
        else:
            record.update(stats)
        return weights_TK.to(x_BLD.dtype), experts_TK, keep_TK, loss

    # ------------------------------------------------------------------ selection
    def _select(self, sel_TE: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if cfg.num_groups > 1:
            # DeepSeek-V3: a group's score is the sum of its two best experts (its best one if it has one).
            sel_TE = limit_to_groups(sel_TE, cfg.num_groups, cfg.topk_groups, 2)
        if cfg.max_routed_ranks:
            # Node-limited routing: a rank's score is the sum of its ceil(K/M) best experts (DeepSeek-V3, 2.1.2).
            sel_TE = limit_to_groups(sel_TE, cfg.routing_ranks, cfg.max_routed_ranks,
                                     -(-self.top_k // cfg.max_routed_ranks))
        return sel_TE.topk(self.top_k, dim=-1).indices

    def _balanced_assignment(self, x_TD: torch.Tensor, B: int, L: int) -> torch.Tensor:
        """Round-robin top-k for reproducible benchmarks (token t's K experts start at t*K, t counted by
        ``token_index``); optional noise is seeded by token content, so an activation-checkpoint recompute routes
        identically."""
        K, E = self.top_k, self.num_experts
        count = self.token_index or (lambda B, L, device: torch.arange(B * L, device=device))
        base_T = count(B, L, x_TD.device) * K
        if self.fake_gate_noise > 0:
            content = (x_TD[:, 0].detach().float() * 9973.0).frac().abs()
            base_T = base_T + (content * self.fake_gate_noise * E).long()
        return (base_T[:, None] + torch.arange(K, device=x_TD.device)[None, :]) % E

    def _capacity_mask(self, experts_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """Keep at most `capacity` assignments per expert, dropping the lowest-scored ones above it."""
        T, K = experts_TK.shape
        # A device tensor, not a Python number: reading the (dynamic) factor would synchronise every layer.
        capacity = torch.ceil(self.capacity_factor * (T * K / self.num_experts))
        flat_e, flat_w = experts_TK.reshape(-1), weights_TK.detach().reshape(-1).float()
        # Sort by expert, then by descending score: the rank within an expert decides who stays.
        order = torch.argsort(flat_w, descending=True, stable=True)
        order = order[torch.argsort(flat_e[order], stable=True)]
        counts = count_ids(flat_e, self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_sorted = torch.arange(flat_e.numel(), device=flat_e.device) - starts[flat_e[order]]
        keep = torch.empty_like(flat_e, dtype=torch.bool)
        keep[order] = rank_sorted < capacity
        return keep.view(T, K)

    # ------------------------------------------------------------------ losses
    def _aux_loss(self, scores_TE, experts_TK, B, L, mask_T=None):
        """Switch-style: E * sum_e f_e * P_e (f: share of assignments, P: mean normalised score).
        "sequence" (DeepSeek-V3) computes it per sequence and averages over sequences.
        `mask_T`: the tokens that count (the others are left out of f and P)."""
        E, K = self.num_experts, self.top_k
        probs_TE = self.score.aux_probs(scores_TE)
        onehot_TE = torch.zeros_like(probs_TE).scatter_(1, experts_TK, 1.0)
        mean = self.token_mean or (lambda x: x)
        if mask_T is not None:  # sums over the tokens that count, over their count (both means over the ranks
            m_BL = mask_T.view(B, L).to(probs_TE.dtype)  # sharing the sequences: their quotient is the global one)
            if self.cfg.aux_loss_type == "sequence":
                n_B1 = mean(m_BL.sum(1, keepdim=True))
                f_BE = mean((onehot_TE.view(B, L, E) * m_BL[..., None]).sum(1)) / (n_B1.clamp(min=1) * K)
                p_BE = mean((probs_TE.view(B, L, E) * m_BL[..., None]).sum(1)) / n_B1.clamp(min=1)
                # a sequence of padding only adds 0 and is not counted
                return (E * (f_BE * p_BE).sum(-1)).sum() / (n_B1 > 0).sum().clamp(min=1)
            m_T1, n = m_BL.reshape(-1, 1), mean(m_BL.sum()).clamp(min=1)
            return E * ((mean((onehot_TE * m_T1).sum(0)) / (n * K)) * (mean((probs_TE * m_T1).sum(0)) / n)).sum()
        if self.cfg.aux_loss_type == "sequence":
            f_BE = mean(onehot_TE.view(B, L, E).sum(1) / (L * K))
            p_BE = mean(probs_TE.view(B, L, E).mean(1))
            return (E * (f_BE * p_BE).sum(-1)).mean()
        f_E = mean(onehot_TE.sum(0) / (B * L * K))
        return E * (f_E * mean(probs_TE.mean(0))).sum()

    # ------------------------------------------------------------------ statistics
    def _stats(self, experts_TK, keep_TK, scores_TE, logits_TE, mask_T=None) -> dict[str, torch.Tensor]:
        """One call's statistics by stat_* buffer name (without the prefix)."""
        flat = experts_TK.reshape(-1)
        # padding (mask_T false) is counted nowhere: weights 0 for its K assignments
        w = mask_T.repeat_interleave(self.top_k).to(scores_TE.dtype) if mask_T is not None else None
        stats = {"routed_per_expert": count_ids(flat, self.num_experts, w)}
        if keep_TK is not None:
            kept = keep_TK.reshape(-1)
            stats["dropped"] = (~kept).sum() if w is None else ((~kept) * w).sum()
            flat = torch.where(kept, flat, self.num_experts)
        stats["tokens_per_expert"] = count_ids(flat, self.num_experts + 1, w)[: self.num_experts]
        p = scores_TE / scores_TE.sum(-1, keepdim=True)
        stats["entropy"] = _mean(-(p * (p + 1e-20).log()).sum(-1), mask_T)
        stats["logit_norm"] = _mean(logits_TE.norm(dim=-1), mask_T)
        return stats

    @torch.no_grad()
    def add_record(self, record: dict[str, torch.Tensor]) -> None:
        """Add one call's statistics (a `record` that forward filled) to the step's: once per real forward."""
        for name, value in record.items():
            getattr(self, f"stat_{name}").add_(value)
        self.stat_calls += 1

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Step statistics as device tensors (no synchronisation); resets them."""
        calls = self.stat_calls.clamp(min=1)
        out = {name: getattr(self, f"stat_{name}").clone() for name in SUMMED_STATS}
        out.update({name: getattr(self, f"stat_{name}") / calls for name in AVERAGED_STATS})
        out["capacity_factor"] = self.capacity_factor.clone()
        for name in SUMMED_STATS + AVERAGED_STATS + ("calls",):
            getattr(self, f"stat_{name}").zero_()
        return out

    @torch.no_grad()
    def update_bias(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower the others.
        Call after the optimizer step with the routed counts (before dropping) summed over data-parallel ranks."""
        if self.cfg.bias_update_rate > 0 and not self.fake_balanced_gate:
            load = tokens_per_expert_E.float()
            self.expert_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)

    @torch.no_grad()
    def update_capacity(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Dynamic capacity: factor = 1 + 0.5 * sigmoid(spread - 1), where spread is the load's coefficient of
        variation std(load) / mean(load) (population std), averaged over the last capacity_window steps.
        Call with the routed counts (before dropping): dropped load is load the capacity failed to cover.
        Stays on the device (no synchronisation)."""
        if not self.cfg.dynamic_capacity:
            return
        load = tokens_per_expert_E.float()
        self.load_history.copy_(torch.roll(self.load_history, 1, 0))
        self.load_history[0] = load / load.mean().clamp(min=1e-9)
        self.history_len.clamp_(max=self.load_history.shape[0] - 1).add_(1)
        filled_W = torch.arange(self.load_history.shape[0], device=load.device) < self.history_len
        cv_W = self.load_history.std(dim=1, correction=0)
        spread = (cv_W * filled_W).sum() / self.history_len
        self.capacity_factor.copy_(1 + 0.5 * torch.sigmoid(spread - 1))


def _mean(x_T: torch.Tensor, mask_T: torch.Tensor | None, token_mean=None) -> torch.Tensor:
    """Mean over the tokens that count (all of them without a mask). `token_mean` (Router.token_mean, when
    sequences are shared by ranks): the count is the ranks' mean count, so that the ranks' mean of the result is
    the mean over all their tokens that count (each rank's sum over the same denominator)."""
    if mask_T is None:
        return x_T.mean()
    m_T = mask_T.to(x_T.dtype)
    n = m_T.sum() if token_mean is None else token_mean(m_T.sum())
    return (x_T * m_T).sum() / n.clamp(min=1)


def limit_to_groups(sel_TE: torch.Tensor, groups: int, keep: int, best: int) -> torch.Tensor:
    """Mask (to -inf) the experts outside each token's `keep` best of `groups` equal contiguous expert groups;
    a group's score is the sum of its `best` highest selection scores (capped at the group's size). Groups are
    expert groups (group-limited routing) or the experts of one EP rank each (node-limited routing).

        limit_to_groups(torch.tensor([[0., 1, 5, 6]]), groups=2, keep=1, best=1)   # [[-inf, -inf, 5, 6]]
    """
    T, E = sel_TE.shape
    grouped_TPX = sel_TE.view(T, groups, E // groups)
    group_TP = grouped_TPX.topk(min(best, E // groups), dim=-1).values.sum(-1)
    top_TP = group_TP.topk(keep, dim=-1).indices
    mask_TP = torch.ones_like(group_TP, dtype=torch.bool).scatter_(1, top_TP, False)
    return grouped_TPX.masked_fill(mask_TP[..., None], float("-inf")).view(T, E)
