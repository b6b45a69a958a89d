"""The LM head and its loss (backend.loss): the whole logits (`full`), moelab's fused linear + cross-entropy
(`chunked`, the default), or a library's fused kernel (`liger`: Liger Kernel, `cce`: Apple's cut-cross-entropy).

Shapes: B batch, L sequence, T = B x L tokens, D hidden, V vocabulary, C tokens of one chunk.

The model calls this inside its own forward (MoETransformer.forward with targets), so FSDP2's hooks on the module
holding the head have gathered its weight, and a pipeline's last stage returns the loss. Semantics of every kind:
the mean cross entropy over the targets that count (neither -100 nor `pad_token_id`), in fp32.

`chunked` never holds the logits [T, V]: per chunk of C tokens it computes the head matmul in the compute dtype,
log-sum-exp, loss and the gradient of the logits (softmax - one-hot) in fp32, and from it both gradients (d hidden
[C, D], d weight [V, D] accumulated in fp32 over the chunks), all in forward: the loss is a scalar, so its
gradients are known up to the scale backward receives (Liger Kernel's scheme: three matmuls, not the four of
recomputing the logits in backward). Backward only scales them. With train.compile on CUDA the per-chunk logits
work is torch.compile'd (inductor fuses the upcast, log-sum-exp and softmax - one-hot into one pass). A head
sharded by vocabulary rows (tensor parallelism) takes the same scheme on its rows, the log-sum-exp combined over
the TP ranks (moelab.backends.vocab_parallel); `full` there computes the loss on the sharded logits.

    loss = lm_loss(h_BLD, model.output, targets_BL, kind="chunked", pad_token_id=-1)
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from moelab.planner.loss import chunk_tokens
from moelab.backends.full_loss import IGNORE_INDEX, _is_dtensor, cross_entropy
from moelab.backends.head_grad import add_weight_grad, weight_grad
from moelab.backends.into_grad import linear

KINDS = ("chunked", "full", "liger", "cce")


def _logits_grad(h_CD: torch.Tensor, w_VD: torch.Tensor, targets_C: torch.Tensor, scale: torch.Tensor):
    """One chunk: (summed loss of its counted targets, d logits [C, V] in the compute dtype) where d logits is
    the gradient of (summed loss * scale)."""
    logits_CV = (h_CD @ w_VD.t()).float()
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    valid_C = targets_C != IGNORE_INDEX
    index_C1 = targets_C.clamp(min=0).unsqueeze(1)
    loss = ((lse_C - logits_CV.gather(1, index_C1).squeeze(1)) * valid_C).sum()
    # softmax - one-hot as one elementwise expression (a compare with the column index, not a scatter into an
    # fp32 copy): compiled, inductor writes d in the compute dtype in one pass over the logits
    onehot_CV = torch.arange(logits_CV.shape[1], device=logits_CV.device) == index_C1
    d_CV = torch.exp(logits_CV - lse_C.unsqueeze(1)) - onehot_CV.to(logits_CV.dtype)
    return loss, (d_CV * (valid_C * scale).unsqueeze(1)).to(h_CD.dtype)


def _logits_loss(h_CD: torch.Tensor, w_VD: torch.Tensor, targets_C: torch.Tensor) -> torch.Tensor:
    """One chunk's summed loss, without gradients (evaluation)."""
    logits_CV = (h_CD @ w_VD.t()).float()
    valid_C = targets_C != IGNORE_INDEX
    picked_C = logits_CV.gather(1, targets_C.clamp(min=0).unsqueeze(1)).squeeze(1)
    return ((torch.logsumexp(logits_CV, dim=-1) - picked_C) * valid_C).sum()


@functools.cache
def _compiled(fn):
    # built on first use: importing torch's compiler costs seconds, which runs that never compile should not pay
    return torch.compile(fn, dynamic=False)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of (h_TD @ w_VD^T) against targets_T (-100 = left out), chunked over tokens; both
    gradients computed in forward (see the module docstring).

        loss = ChunkedLinearCrossEntropy.apply(h_TD, w_VD, targets_T, 1024, torch.bfloat16, False)
    """

    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, chunk: int, dtype: torch.dtype, compiled: bool):
        T = h_TD.shape[0]
        step = _compiled(_logits_grad) if compiled else _logits_grad
        w_c = w_VD.to(dtype)
        count = (targets_T != IGNORE_INDEX).sum()
        scale = 1.0 / count.clamp(min=1).float()
        loss = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        dh_TD = torch.empty(h_TD.shape, dtype=dtype, device=h_TD.device)
        dw_VD = None
        for s in range(0, T, chunk):
            h_CD = h_TD[s:s + chunk].to(dtype)
            loss_c, d_CV = step(h_CD, w_c, targets_T[s:s + chunk], scale)
            loss += loss_c
            torch.mm(d_CV, w_c, out=dh_TD[s:s + chunk])
            if dw_VD is None:
                dw_VD = weight_grad(d_CV, h_CD)
            else:
                add_weight_grad(dw_VD, d_CV, h_CD)
            del d_CV
        # kept in the dtypes autograd hands them back in: a bf16 head's gradient needs no fp32 copy until backward
        ctx.dh_TD, ctx.dw_VD = dh_TD.to(h_TD.dtype), dw_VD.to(w_VD.dtype)
        return loss * scale

    @staticmethod
    def backward(ctx, grad_loss):
        dh_TD, dw_VD = ctx.dh_TD, ctx.dw_VD
        del ctx.dh_TD, ctx.dw_VD
        # scaled in place: nothing else holds them, and a second [V, D] copy would sit next to the activations
        return dh_TD.mul_(grad_loss.to(dh_TD.dtype)), dw_VD.mul_(grad_loss.to(dw_VD.dtype)), None, None, None, None


def chunked_loss_no_grad(h_TD, w_VD, targets_T, chunk: int, dtype: torch.dtype, compiled: bool) -> torch.Tensor:
    """The same loss without gradients (evaluation): one chunk of logits at a time, nothing kept."""
    step = _compiled(_logits_loss) if compiled else _logits_loss
    w_c = w_VD.to(dtype)
    total = sum(step(h_TD[s:s + chunk].to(dtype), w_c, targets_T[s:s + chunk]) for s in range(0, h_TD.shape[0], chunk))
    return total / (targets_T != IGNORE_INDEX).sum().clamp(min=1).float()


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on (as nn.Linear would), else the input's."""
    kind = h.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype


def lm_loss(h_BLD: torch.Tensor, head: nn.Module, targets_BL: torch.Tensor, kind: str = "chunked",
            pad_token_id: int = -1, compiled: bool = False, chunk: int = 0,
            backward_scale: float = 1.0) -> torch.Tensor:
    """The mean next-token loss of hidden states `h_BLD` through the LM head `head` (an nn.Linear without bias;
    the embedding when tied) against `targets_BL`; `chunk`: backend.loss_chunk_tokens (0 = auto);
    `backward_scale`: the scale backward is expected to bring (the full loss's in-place kernel computes the
    logits' gradient with it in forward; moelab.backends.loss_kernel)."""
    if kind == "full":  # the logits are this call's own: the in-place kernel may take their buffer
        return cross_entropy(linear(head, h_BLD), targets_BL, compiled=compiled, pad_token_id=pad_token_id,
                             backward_scale=backward_scale)
    if type(head) is not nn.Linear or head.bias is not None:
        raise TypeError(f"backend.loss={kind!r} computes the LM head itself and needs a plain nn.Linear without "
                        f"bias, not {type(head).__name__}; set backend.loss=full")
    if pad_token_id >= 0:
        targets_BL = targets_BL.masked_fill(targets_BL == pad_token_id, IGNORE_INDEX)
    if _is_dtensor(head.weight):  # a vocabulary-parallel head (tensor parallelism): this rank's rows, chunked
        if kind != "chunked":
            raise ValueError(f"backend.loss={kind!r} is not vocabulary-parallel; under parallel.tp take "
                             "backend.loss=chunked or full")
        from moelab.backends.vocab_parallel import vocab_parallel_linear_cross_entropy

        dtype = compute_dtype(h_BLD)
        with torch.autocast(h_BLD.device.type, enabled=False):
            return vocab_parallel_linear_cross_entropy(h_BLD, head.weight, targets_BL, chunk, dtype)
    h_TD, targets_T, w_VD = h_BLD.flatten(0, 1), targets_BL.flatten(), head.weight
    dtype = compute_dtype(h_TD)
    if kind == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        # the head's gradient accumulated in fp32 over Liger's chunks, as `chunked` does
        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, accum_dtype=torch.float32)(
            w_VD.to(dtype), h_TD.to(dtype), targets_T)
    if kind == "cce":
        from cut_cross_entropy import linear_cross_entropy

        # filter_eps=None: every gradient entry computed (its default skips those below a threshold)
        return linear_cross_entropy(h_TD.to(dtype), w_VD.to(dtype), targets_T, ignore_index=IGNORE_INDEX,
                                    filter_eps=None)
    if kind != "chunked":
        raise ValueError(f"backend.loss={kind!r}: choose one of {', '.join(KINDS)}")
    C = chunk_tokens(w_VD.shape[0], h_TD.shape[0], chunk)
    compiled = compiled and h_TD.is_cuda
    with torch.autocast(h_TD.device.type, enabled=False):
        if torch.is_grad_enabled() and (h_TD.requires_grad or w_VD.requires_grad):
            return ChunkedLinearCrossEntropy.apply(h_TD, w_VD, targets_T, C, dtype, compiled)
        return chunked_loss_no_grad(h_TD, w_VD, targets_T, C, dtype, compiled)
