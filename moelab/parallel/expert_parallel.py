"""Expert parallelism: each of `ep` ranks owns num_experts/ep experts, and tokens travel to them by all-to-all.

Shapes: T tokens on this rank, K top-k, D hidden, E experts (global), R = ep ranks, X = E/R local experts,
N rows this rank sends (kept assignments), W rows it receives (docs/shapes.md).

    moe.dispatcher = AllToAllDispatcher(ep_group)     # moelab.parallel.distributed installs it per MoE layer
    shard_experts(moe.experts, ep_rank, ep)           # keep only this rank's experts (on the meta device)
    scale_expert_gradients(moe.experts, ep)           # the data-parallel mean of their gradients (see below)

One MoE layer's forward, implementing the dispatcher interface of moelab.model.moe (LocalDispatcher):
  1. sort the T*K assignments by expert (dropped ones, when capacity is on, sort last and are not sent);
  2. exchange the per-expert counts with an all-to-all of a tiny [R, X] tensor;
  3. ONE device-to-host copy per layer: the split sizes of the uneven exchange (and the received counts) are
     needed as Python ints by ``all_to_all_single``; this is the layer's only host synchronisation;
  4. an autograd-aware uneven ``all_to_all_single`` (``_AllToAll``) sends the rows;
  5. the rows arrive rank-major ([from rank 0: its rows for my experts 0..X-1], [from rank 1: ...]) and are
     permuted to local-expert-major for the grouped GEMM;
  6. combine reverses 5 and 4 and sums the top-k rows of each token weighted by the router weights (they stay on
     the token's rank, so the experts get none: ``Dispatcher.row_weights`` is None here, where the local
     dispatcher's experts weight their rows before the down projection).
The backward pass of 4 is the mirrored all-to-all, so gradients take the same route back.

With parallel.ep_overlap, ``OverlappedAllToAllDispatcher.route`` runs 1-6 on the two halves of the tokens
(after routing: same choices, drops and counts), step 3 still once for both, and starts one half's exchange
with ``async_op=True`` before the other half's experts run (on NCCL the wait makes the compute stream wait for
NCCL's; no host synchronisation is added). The experts module is called once per half, so FSDP2 enters it
twice per micro batch (two unshards of the expert weights in forward, two reduce-scatters in backward).

Gradient scale of the experts: each rank's loss is a mean over its own tokens, and an expert's gradient is the
sum over every EP peer's tokens routed to it; FSDP then averages over the expert-FSDP mesh ((dp*cp)/ep ranks).
The data-parallel mean needs 1/(dp*cp), i.e. another 1/ep. ``scale_expert_gradients`` applies it around the
experts module, whatever the dispatcher (gradient into the experts x 1/ep, gradient out of them x ep): exact
for powers of two, and independent of FSDP's custom divide factors (gloo has no PREMUL_SUM, and the factor's
handling on one-rank meshes changed between torch releases).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moelab.model.moe import Dispatcher


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _exchange(x_ND, out_splits: list[int], in_splits: list[int], group, async_op: bool = False):
    """One uneven all_to_all_single: (the received rows, the collective's handle when `async_op`)."""
    x_ND = x_ND.contiguous()
    y_WD = x_ND.new_empty((sum(out_splits),) + tuple(x_ND.shape[1:]))
    work = dist.all_to_all_single(y_WD, x_ND, out_splits, in_splits, group=group, async_op=async_op)
    return y_WD, work


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single whose backward is the mirrored exchange (output splits <-> input splits)."""

    @staticmethod
    def forward(ctx, x_ND, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x_ND, out_splits, in_splits, group)[0]

    @staticmethod
    def backward(ctx, grad_WD):
        out_splits, in_splits = ctx.splits
        return _exchange(grad_WD, in_splits, out_splits, ctx.group)[0], None, None, None


def all_to_all(x_ND, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x_ND, out_splits, in_splits, group)


class AllToAllDispatcher(Dispatcher):
    """Token dispatch over an expert-parallel process group with torch.distributed's all-to-all.

    The MoE layer keeps `num_experts` global (routing picks among all experts); the experts module holds only
    this rank's X = E/R experts, and receives `counts_X` for them.

        moe.dispatcher = AllToAllDispatcher(meshes.ep_group)
    """

    exchanges = True

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.counts = DispatchCounts(self.ep)
        # The overlapped exchange's halves run eagerly inside a compiled step (a graph break each). They are wrapped
        # here, not with a decorator at import: importing torch._dynamo takes seconds that a run without EP never
        # needs.
        self._start_all_to_all = torch.compiler.disable(start_all_to_all)
        self._wait_all_to_all = torch.compiler.disable(wait_all_to_all)

    def exchange_counts(self, x_TD, flat_TK, send_CRX):
        """Steps 2 and 3 for C chunks of the tokens at once: one all-to-all of the [R, C, X] counts and ONE
        device-to-host copy. Returns recv_CRX (recv[c, r, x]: rows of chunk c from rank r for my expert x) and
        the host split sizes [C][R] to send and to receive (and adds this dispatch to ``self.counts``)."""
        C, R, X = send_CRX.shape
        send_RCX = send_CRX.transpose(0, 1).contiguous()  # grouped by destination rank: even splits
        recv_RCX = torch.empty_like(send_RCX)
        dist.all_to_all_single(recv_RCX, send_RCX, group=self.group)
        recv_CRX = recv_RCX.transpose(0, 1)
        # The one device-to-host copy of this layer (see the module docstring), with the ranks each token reaches.
        host = torch.cat([send_CRX.sum(2).reshape(-1), recv_CRX.sum(2).reshape(-1),
                          ranks_per_token(flat_TK.view(x_TD.shape[0], -1 if len(x_TD) else 0), X, R)]).tolist()
        send, recv = host[:C * R], host[C * R:2 * C * R]
        send_splits, recv_splits = ([part[c * R:(c + 1) * R] for c in range(C)] for part in (send, recv))
        self.counts.add([sum(s) for s in zip(*send_splits)], host[2 * C * R:], self.me,
                        x_TD.shape[-1] * x_TD.element_size())
        return recv_CRX, send_splits, recv_splits

    def dispatch(self, x_TD, experts_TK, keep_TK, num_experts):
        flat_TK = sort_key(experts_TK, keep_TK, num_experts)
        send_RX = expert_counts(flat_TK, num_experts, self.ep)
        recv_CRX, send_splits, recv_splits = self.exchange_counts(x_TD, flat_TK, send_RX[None])
        rows = ChunkRows(flat_TK, recv_CRX[0], send_splits[0], recv_splits[0], 0, experts_TK.shape[1])
        x_recv_WD = all_to_all(x_TD[rows.token_N], recv_splits[0], send_splits[0], self.group)
        return x_recv_WD[rows.perm_W], recv_CRX[0].sum(0), rows

    def combine(self, y_WD, rows, weights_TK, keep_TK, counts_X):
        y_back_ND = all_to_all(rows.rank_major(y_WD), rows.send_splits, rows.recv_splits, self.group)
        return weighted_sum([rows], [y_back_ND], weights_TK)


class OverlappedAllToAllDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher with its exchanges overlapped with the experts' compute (parallel.ep_overlap).

    Each micro batch's tokens are split in two chunks (first and second half) AFTER routing, so the router's
    choices, capacity drops, aux losses and counts are those of the whole micro batch. Chunk 1's dispatch travels
    while chunk 0's experts compute, and chunk 0's combine while chunk 1's experts compute; backward mirrors it
    (chunk 0's combine gradient travels during chunk 1's expert backward, chunk 1's dispatch gradient during
    chunk 0's). Every row meets the same expert weights as without the split, so the result is the same up to
    the experts' GEMMs seeing two smaller batches. The counts of both chunks go in one exchange and one
    device-to-host copy, as in the plain path; the rows take 4 all-to-alls per direction instead of 2.

        moe.dispatcher = OverlappedAllToAllDispatcher(meshes.ep_group)   # moelab.parallel.distributed
    """

    def route(self, experts, x_TD, weights_TK, experts_TK, keep_TK, num_experts):
        T, K = experts_TK.shape
        if T < 2:
            return super().route(experts, x_TD, weights_TK, experts_TK, keep_TK, num_experts)
        g, h = self.group, T // 2
        flat_TK = sort_key(experts_TK, keep_TK, num_experts)
        halves = (flat_TK[:h * K], flat_TK[h * K:])
        send_CRX = torch.stack([expert_counts(f, num_experts, self.ep) for f in halves])
        recv_CRX, send, recv = self.exchange_counts(x_TD, flat_TK, send_CRX)
        r0, r1 = (ChunkRows(f, recv_CRX[c], send[c], recv[c], c * h, K) for c, f in enumerate(halves))
        x0_WD = all_to_all(x_TD[r0.token_N], recv[0], send[0], g)
        travel1 = _Travel()
        x1_WD = self._start_all_to_all(x_TD[r1.token_N], recv[1], send[1], g, travel1)   # chunk 1 travels ...
        y0_WD = experts(x0_WD[r0.perm_W], recv_CRX[0].sum(0))                        # ... while chunk 0 computes
        x1_WD = self._wait_all_to_all(x1_WD, recv[1], send[1], g, travel1)
        travel0 = _Travel()
        y0_ND = self._start_all_to_all(r0.rank_major(y0_WD), send[0], recv[0], g, travel0)  # chunk 0 returns ...
        y1_WD = r1.rank_major(experts(x1_WD[r1.perm_W], recv_CRX[1].sum(0)))          # ... while chunk 1 computes
        y0_ND = self._wait_all_to_all(y0_ND, send[0], recv[0], g, travel0)
        y1_ND = all_to_all(y1_WD, send[1], recv[1], g)
        return weighted_sum([r0, r1], [y0_ND, y1_ND], weights_TK)


class _Travel:
    """An all-to-all in flight between its start and its wait: the forward exchange, then its mirror in
    backward. Holds the tensors until the wait (the collective writes into the output meanwhile)."""

    def start(self, x_ND, out_splits, in_splits, group) -> torch.Tensor:
        x_ND = x_ND.contiguous()  # the very tensor the collective reads stays referenced until the wait
        y_WD, self.work = _exchange(x_ND, out_splits, in_splits, group, async_op=True)
        self.tensors = (x_ND, y_WD)
        return y_WD

    def wait(self) -> torch.Tensor:
        """The output, once it has arrived (on NCCL: the current stream waits for it; the host does not)."""
        self.work.wait()
        y_WD = self.tensors[1]
        self.work = self.tensors = None
        return y_WD


class _StartAllToAll(torch.autograd.Function):
    """Starts an uneven all-to-all and returns its output before it has arrived (read it only after
    ``_WaitAllToAll``). Backward: waits for the mirrored exchange that _WaitAllToAll's backward started, and
    returns what it brought (the gradient autograd passes in only orders the two)."""

    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group, travel: _Travel):
        ctx.travel = travel
        return travel.start(x_ND, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_WD):
        return ctx.travel.wait(), None, None, None, None


class _WaitAllToAll(torch.autograd.Function):
    """Waits for the exchange _StartAllToAll started. Backward: starts the mirrored exchange of the gradient
    (output splits <-> input splits), which _StartAllToAll's backward waits for."""

    @staticmethod
    def forward(ctx, y_WD, out_splits, in_splits, group, travel: _Travel):
        travel.wait()
        ctx.args = out_splits, in_splits, group, travel
        return y_WD.view_as(y_WD)

    @staticmethod
    def backward(ctx, grad_WD):
        out_splits, in_splits, group, travel = ctx.args
        travel.start(grad_WD, in_splits, out_splits, group)
        return grad_WD, None, None, None, None


def start_all_to_all(x_ND, out_splits, in_splits, group, travel: _Travel) -> torch.Tensor:
    return _StartAllToAll.apply(x_ND, out_splits, in_splits, group, travel)


def wait_all_to_all(y_WD, out_splits, in_splits, group, travel: _Travel) -> torch.Tensor:
    return _WaitAllToAll.apply(y_WD, out_splits, in_splits, group, travel)


def sort_key(experts_TK, keep_TK, num_experts) -> torch.Tensor:
    """[T*K] expert ids to sort the assignments by; dropped ones get the sentinel `num_experts` (sorted last,
    never sent)."""
    flat_TK = experts_TK.reshape(-1)
    return flat_TK if keep_TK is None else torch.where(keep_TK.reshape(-1), flat_TK, num_experts)


def expert_counts(flat_N, num_experts: int, ep: int) -> torch.Tensor:
    """[R, X]: this rank's rows for each rank's local experts (the sentinel's are not counted)."""
    return torch.bincount(flat_N, minlength=num_experts + 1)[:num_experts].view(ep, num_experts // ep)


class ChunkRows:
    """Where the rows of one chunk of tokens go (steps 1, 4 and 5 of the module docstring): `token_N` the token
    of each sent row (expert-major), `slot_N` its place among the micro batch's T*K assignments, `perm_W` the
    received rows from rank-major to local-expert-major, and the host split sizes.

        rows = ChunkRows(flat_TK, recv_RX, send_splits, recv_splits, token_offset=0, K=2)
    """

    def __init__(self, flat_N, recv_RX, send_splits, recv_splits, token_offset: int, K: int):
        R, X = recv_RX.shape
        N, W = sum(send_splits), sum(recv_splits)
        order_N = torch.argsort(flat_N, stable=True)[:N]
        self.slot_N = order_N + token_offset * K
        self.token_N = self.slot_N // K
        expert_of_row_W = torch.repeat_interleave(torch.arange(R * X, device=flat_N.device) % X,
                                                  recv_RX.reshape(-1), output_size=W)
        self.perm_W = torch.argsort(expert_of_row_W, stable=True)
        self.send_splits, self.recv_splits = send_splits, recv_splits

    def rank_major(self, y_WD: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(y_WD).index_copy(0, self.perm_W, y_WD)


def weighted_sum(rows: list[ChunkRows], y_back: list[torch.Tensor], weights_TK) -> torch.Tensor:
    """Step 6: the returned rows back at their tokens' slots, summed over top-k with the router weights. Dropped
    assignments were never sent: their rows stay zero (and their weights are zero too)."""
    T, K = weights_TK.shape
    slot_N = rows[0].slot_N if len(rows) == 1 else torch.cat([r.slot_N for r in rows])
    y_ND = y_back[0] if len(y_back) == 1 else torch.cat(y_back)
    y_TKD = y_ND.new_zeros(T * K, y_ND.shape[-1]).index_copy(0, slot_N, y_ND)
    return (y_TKD.view(T, K, y_ND.shape[-1]) * weights_TK[..., None]).sum(1)  # T may be 0 (hierarchical)


def ranks_per_token(experts_TK: torch.Tensor, X: int, R: int) -> torch.Tensor:
    """[R ranks, then R + 1 counts]: for each rank, how many tokens send it at least one row; then how many
    tokens reach exactly 0, 1, ..., R ranks. Expert ids >= R * X (dropped assignments) reach no rank."""
    T = experts_TK.shape[0]
    dest_TK = (experts_TK // X).clamp(max=R)
    hit_TR = torch.zeros(T, R + 1, dtype=torch.bool, device=experts_TK.device).scatter_(1, dest_TK, True)[:, :R]
    return torch.cat([hit_TR.sum(0), torch.bincount(hit_TR.sum(1), minlength=R + 1)])


class DispatchCounts:
    """What this rank's dispatches sent since the last ``pop``, counted from the split sizes (host ints the
    dispatcher reads anyway): rows for other ranks and their bytes (one row per kept token-expert assignment,
    what AllToAllDispatcher sends), token-rank pairs for other ranks and their bytes (what a dispatcher that
    sends each token once per destination rank, like DeepEP, would send), and how many tokens reached
    exactly 0..R ranks (own rank included). Forward dispatch only; combine and backward mirror it.

        counts = DispatchCounts(ep=2); counts.add([3, 5], [2, 4, 0, 1, 3], me=0, row_bytes=256)
        counts.pop()["dispatch_bytes"]     # [1280.0]: 5 rows to rank 1
    """

    def __init__(self, ep: int):
        self.ep = ep
        self.pop()

    def add(self, send_splits: list[int], per_token: list[int], me: int, row_bytes: int) -> None:
        R = self.ep
        pairs_R, hist = per_token[:R], per_token[R:]
        rows, pairs = sum(send_splits) - send_splits[me], sum(pairs_R) - pairs_R[me]
        for key, value in (("dispatch_rows", rows), ("dispatch_bytes", rows * row_bytes),
                           ("dispatch_token_ranks", pairs), ("dispatch_once_per_rank_bytes", pairs * row_bytes)):
            self.values[key][0] += value
        self.values["tokens_by_ranks_reached"] = [a + b for a, b in zip(self.values["tokens_by_ranks_reached"], hist)]

    def pop(self) -> dict[str, list[float]]:
        out = getattr(self, "values", None)
        self.values = {k: [0.0] for k in ("dispatch_rows", "dispatch_bytes", "dispatch_token_ranks",
                                          "dispatch_once_per_rank_bytes")}
        self.values["tokens_by_ranks_reached"] = [0.0] * (self.ep + 1)
        return out


def shard_experts(experts: nn.Module, ep_rank: int, ep: int) -> None:
    """Keep experts [ep_rank * X, (ep_rank + 1) * X) of a stacked-experts module built on the meta device:
    every parameter's dim 0 is the expert. `expert_offset` tells init_weights which global experts these are."""
    E = experts.num_experts
    if E % ep:
        raise ValueError(f"moelab.parallel.expert_parallel: {E} experts cannot be split over ep={ep} ranks")
    X = E // ep
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.shape[0] != E:
            raise ValueError(f"moelab.parallel.expert_parallel: {name} has dim 0 = {p.shape[0]}, expected the "
                             f"expert dimension {E}")
        local = torch.empty((X,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device)
        setattr(experts, name, nn.Parameter(local, requires_grad=p.requires_grad))
    experts.num_experts = X
    experts.expert_offset = ep_rank * X


def scale_expert_gradients(experts: nn.Module, ep: int) -> None:
    """Identity in the forward pass; in backward, the experts' weights get 1/ep of their gradient and the rows
    leaving them get it back (x ep), so only the expert parameters are scaled (see the module docstring)."""

    def pre_hook(module, args):
        return (_ScaleGrad.apply(args[0], float(ep)),) + tuple(args[1:])

    def post_hook(module, args, output):
        return _ScaleGrad.apply(output, 1.0 / ep)

    experts.register_forward_pre_hook(pre_hook)
    experts.register_forward_hook(post_hook)
