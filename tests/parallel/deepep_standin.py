"""A stand-in for ``deep_ep`` on CPU (gloo), for testing moelab's side of backend.dispatcher=deepep where there is
no GPU: the Python contract of DeepEP's intranode ``Buffer`` (commit 567632d, the one gallery/scripts/deepep builds),
read from its deep_ep/buffer.py and csrc/deep_ep.cpp, computed with torch.distributed's all_to_all_single. It is
NOT DeepEP: its CUDA kernels are checked on the GPU machine by gallery/scripts/deepep/check.py. What it keeps:
- the tensors' dtypes and shapes, and the host-side checks DeepEP makes (int64 top-k ids, fp32 top-k weights,
  rows of a multiple of 32 bytes, bf16 combine data, no top-k arguments in cached mode, 2/4/8 ranks);
- the received order: tokens from rank 0 first, then rank 1, ..., each source's tokens in their order; received
  top-k ids local to this rank (-1 for other ranks' experts), their weights 0 there;
- combine sums each token's rows from every rank in fp32 and returns the input's dtype; its top-k weights too.

    sys.modules["deep_ep"] = deepep_standin   # then moelab.parallel.deepep.DeepEPDispatcher builds on it
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class EventOverlap:
    """DeepEP's event wrapper; the stand-in runs synchronously.

        EventOverlap().current_stream_wait()
    """

    def current_stream_wait(self) -> None:
        pass


class Config:
    """The per-rank-count tuning config; only its buffer-size hint is used by moelab.

        Config().get_nvl_buffer_size_hint(4096, 2)
    """

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 10 * num_ranks * 256 * (hidden_bytes + 128 * 16)


def _exchange(x, send_splits, recv_splits, group):
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class Buffer:
    """DeepEP's intranode normal-kernel API (layout, dispatch, cached dispatch, combine) over a gloo group.

        buf = Buffer(group, Config().get_nvl_buffer_size_hint(128, 2), 0)
    """

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, explicitly_destroy: bool = False):
        self.group, self.rank, self.group_size = group, dist.get_rank(group), dist.get_world_size(group)
        assert self.group_size in (2, 4, 8), "intranode kernels: 2, 4 or 8 ranks"
        assert num_nvl_bytes > 0 and num_nvl_bytes % 128 == 0 and num_rdma_bytes == 0
        self.explicitly_destroy, self.destroyed = explicitly_destroy, False

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        assert not self.destroyed
        dist.barrier(group=self.group)  # DeepEP's destroy synchronises the ranks (over NVLink)
        self.destroyed = True

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config()

    get_combine_config = get_dispatch_config

    def get_dispatch_layout(self, topk_idx, num_experts):
        assert topk_idx.dtype == torch.int64 and topk_idx.dim() == 2 and topk_idx.is_contiguous()
        R, X = self.group_size, num_experts // self.group_size
        valid = topk_idx >= 0
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        in_rank_TR = torch.zeros(topk_idx.shape[0], R + 1, dtype=torch.bool)
        in_rank_TR.scatter_(1, torch.where(valid, topk_idx // X, R), True)
        in_rank_TR = in_rank_TR[:, :R].contiguous()
        return in_rank_TR.sum(0).to(torch.int32), None, per_expert, in_rank_TR, EventOverlap()

    def _check_rows(self, x):
        assert x.dim() == 2 and x.is_contiguous() and (x.shape[1] * x.element_size()) % 32 == 0, \
            "rows of a multiple of 32 bytes (DeepEP copies pairs of int4)"

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, **_):
        self._check_rows(x)
        if handle is not None:
            assert topk_idx is None and topk_weights is None, "cached mode takes no top-k arguments"
            tokens_R, send_splits, recv_splits, _ = handle
            return _exchange(x[torch.cat(tokens_R)], send_splits, recv_splits, self.group), None, None, None, \
                None, EventOverlap()
        assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
        assert num_tokens_per_expert.dtype == torch.int32 and is_token_in_rank.dtype == torch.bool
        R = self.group_size
        X = num_tokens_per_expert.shape[0] // R
        tokens_R = [torch.nonzero(is_token_in_rank[:, r]).flatten() for r in range(R)]
        send_splits = [len(t) for t in tokens_R]
        recv_splits = [0] * R
        sizes = torch.tensor(send_splits)
        got = torch.empty_like(sizes)
        dist.all_to_all_single(got, sizes, group=self.group)
        recv_splits = got.tolist()
        handle = (tokens_R, send_splits, recv_splits, x.shape[0])
        idx_send, w_send = [], []
        for r, t in enumerate(tokens_R):  # top-k ids as the receiver sees them: local, or -1 with weight 0
            local = (topk_idx[t] >= r * X) & (topk_idx[t] < (r + 1) * X)
            idx_send.append(torch.where(local, topk_idx[t] - r * X, -1))
            w_send.append(torch.where(local, topk_weights[t], 0.0))
        order = torch.cat(tokens_R)
        recv_x = _exchange(x[order], send_splits, recv_splits, self.group)
        recv_idx = _exchange(torch.cat(idx_send), send_splits, recv_splits, self.group)
        recv_w = _exchange(torch.cat(w_send), send_splits, recv_splits, self.group)
        counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=X).tolist()
        return recv_x, recv_idx, recv_w, counts, handle, EventOverlap()

    def combine(self, x, handle, topk_weights=None, **_):
        self._check_rows(x)
        assert x.dtype == torch.bfloat16, "DeepEP's combine kernel takes bf16 only"
        tokens_R, send_splits, recv_splits, T = handle
        order = torch.cat(tokens_R)
        back = _exchange(x.float(), recv_splits, send_splits, self.group)
        y = torch.zeros(T, x.shape[1]).index_add_(0, order, back).to(x.dtype)
        w = None
        if topk_weights is not None:
            assert topk_weights.dtype == torch.float32 and topk_weights.shape[1] <= 32
            w = torch.zeros(T, topk_weights.shape[1]).index_add_(
                0, order, _exchange(topk_weights, recv_splits, send_splits, self.group))
        return y, w, EventOverlap()
