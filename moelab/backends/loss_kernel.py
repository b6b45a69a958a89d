"""The full loss's Triton kernel (backend.loss=full on CUDA): the token-mean cross entropy and the logits' gradient in
one kernel, the gradient written over the logits.

Shapes: T tokens, V vocabulary.

The loss is a scalar that backward only scales, so its gradient (softmax - one-hot) / counted tokens is known in
forward up to that scale (Liger Kernel's scheme). One program per token reads its row of logits twice: the running
max and sum of exponentials (the log-sum-exp), then, walking the row backwards (its last blocks the likeliest still
in L2), the gradient, written in the logits' dtype into the logits' own buffer. The compiled loss it replaces read
the logits three times in two kernels and wrote the gradient into a second [T, V] buffer: 3.41 ms against this
kernel's 2.49 ms on an H100 at 8,192 x 151,936, and 2.3 GiB less at the loss's peak (issue 41 call 29's check,
gallery/scripts/gpu_check_loss_kernel.py; with about 500 rows in flight the second read mostly misses L2).
Fewer rows in flight (ROWS_PER_SM programs per SM walking rows) keep more of each row in L2 but too few loads in
flight: 2.66-3.55 ms against 2.42 in call 30's sweep. The L2 hints (EVICT: the first read keeps the row, the second
lets it go) change no arithmetic: 2.37 ms there, and the step with them 117.2 against 119.3 ms at global batch 2 in
call 31 (within the step's spread, 116-121 ms), so they are on.

The caller passes the scale backward will bring (`backward_scale`: the micro batch's weight in the step's loss,
BatchContext.loss_scale) and must not use the logits after the call. Backward checks the scale it gets on the GPU
and rescales the gradient only where it differs (a kernel whose programs return at once when it does not), so no
scale is ever wrong, and none is paid for when the caller said it right.

    loss = cross_entropy_in_place(logits_TV, targets_T, backward_scale=1 / micro_batches)
    (loss / micro_batches).backward()          # logits_TV.grad's buffer is logits_TV's own

Targets equal to -100 are left out (the mean is over the others; none counted: 0).
"""
from __future__ import annotations

import functools

import torch

from moelab.backends.flat import cdiv, kernel_devices, triton_available
from moelab.data.sft import IGNORE_INDEX

BLOCK, WARPS = 8192, 16  # one row block of logits per loop step, and the warps of a program
ROWS_PER_SM = 0  # programs per SM, each walking rows strided by the grid (fewer rows in flight); 0: one per row
EVICT = True  # the first read asks L2 to keep the row (evict_last), the second to drop it (evict_first)
RESCALE_BLOCK, RESCALE_PROGRAMS = 4096, 1024  # the backward's rescale: a grid of programs striding over the gradient


def applies(logits_TV: torch.Tensor) -> bool:
    """Whether the kernel takes these logits: rows of contiguous floats on a kernel device (CUDA; the CPU under
    Triton's interpreter)."""
    return (logits_TV.dim() == 2 and logits_TV.stride(1) == 1 and logits_TV.stride(0) == logits_TV.shape[1]
            and logits_TV.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and logits_TV.device.type in kernel_devices() and triton_available())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_cross_entropy_kernel(x_ptr, targets_ptr, loss_ptr, scale_ptr, T, V, ignore_index,
                                     WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr, FIRST_READ: tl.constexpr,
                                     SECOND_READ: tl.constexpr):  # the reads' L2 eviction policies ("": none)
        for r in range(tl.program_id(0), T, tl.num_programs(0)):  # a grid of T: one row each
            row = tl.zeros([], tl.int64) + r  # int64 offsets (T x V may pass 2^31); the interpreter gives ints
            x_row = x_ptr + row * V
            t = tl.load(targets_ptr + row)
            valid = t != ignore_index
            m = tl.full([], float("-inf"), tl.float32)  # running max
            s = tl.zeros([], tl.float32)  # running sum of exp(x - m)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(x_row + offs, mask=offs < V, other=float("-inf"), eviction_policy=FIRST_READ).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, 0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
                m = m_new
            lse = m + tl.log(s)
            x_t = tl.load(x_row + tl.where(valid, t, 0)).to(tl.float32)  # read before the gradient overwrites it
            tl.store(loss_ptr + row, tl.where(valid, lse - x_t, 0.0))
            if WRITE_GRAD:
                scale = tl.where(valid, tl.load(scale_ptr), 0.0)
                n_blocks = tl.cdiv(V, BLOCK)
                for i in range(0, n_blocks):  # last block first: the blocks just read are the likeliest in L2
                    offs = (n_blocks - 1 - i) * BLOCK + tl.arange(0, BLOCK)
                    mask = offs < V
                    x = tl.load(x_row + offs, mask=mask, other=0.0, eviction_policy=SECOND_READ)
                    d = (tl.exp(x.to(tl.float32) - lse) - tl.where(offs == t, 1.0, 0.0)) * scale
                    tl.store(x_row + offs, d.to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def cross_entropy_grad_mul_kernel(d_ptr, got_ptr, expected, n, BLOCK: tl.constexpr):
        factor = tl.load(got_ptr).to(tl.float32) / expected
        if factor != 1.0:
            for i in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
                offs = (i + tl.zeros([], tl.int64)) * BLOCK + tl.arange(0, BLOCK)  # int64: n may pass 2^31
                mask = offs < n
                d = tl.load(d_ptr + offs, mask=mask).to(tl.float32)
                tl.store(d_ptr + offs, (d * factor).to(d_ptr.dtype.element_ty), mask=mask)

    return softmax_cross_entropy_kernel, cross_entropy_grad_mul_kernel


def _row_losses(logits_TV: torch.Tensor, targets_T: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 [T]: each token's loss (0 where left out); with `scale` (fp32, 0-d) the logits become their gradient
    times scale."""
    T, V = logits_TV.shape
    losses_T = torch.empty(T, dtype=torch.float32, device=logits_TV.device)
    ce, _ = _kernels()
    ce[(programs(logits_TV),)](logits_TV, targets_T.contiguous(), losses_T, losses_T if scale is None else scale, T,
                               V, IGNORE_INDEX, WRITE_GRAD=scale is not None, BLOCK=BLOCK,
                               FIRST_READ="evict_last" if EVICT else "", SECOND_READ="evict_first" if EVICT else "",
                               num_warps=WARPS)
    return losses_T


def config_name() -> str:
    """The kernel's setting as the check's records name it: "8192x16" (BLOCK x WARPS, a program per row), with
    "-rows2" for ROWS_PER_SM 2 and "-evict" for EVICT."""
    return f"{BLOCK}x{WARPS}" + (f"-rows{ROWS_PER_SM}" if ROWS_PER_SM > 0 else "") + ("-evict" if EVICT else "")


def set_config(name: str) -> None:
    """Set BLOCK, WARPS, ROWS_PER_SM and EVICT from a name of config_name's form (a measurement's trial, e.g.
    gallery/scripts/gpu_perf.py --loss-kernel-trial; not a setting)."""
    parts = name.split("-")
    try:
        block, warps = (int(x) for x in parts[0].split("x"))
        rows = [int(x[4:]) for x in parts[1:] if x.startswith("rows")]
        if block <= 0 or block & (block - 1) or warps <= 0 or len(rows) > 1 or \
                len(parts) - 1 != len(rows) + parts[1:].count("evict"):
            raise ValueError
    except ValueError:
        raise ValueError(f"loss kernel config {name!r}: expected BLOCKxWARPS[-rowsN][-evict] with BLOCK a power "
                         f"of two, e.g. 8192x16 or 16384x32-rows1-evict") from None
    global BLOCK, WARPS, ROWS_PER_SM, EVICT
    BLOCK, WARPS, ROWS_PER_SM, EVICT = block, warps, (rows[0] if rows else 0), "evict" in parts


def programs(logits_TV: torch.Tensor) -> int:
    """The loss kernel's grid: one program per row, or ROWS_PER_SM per SM (at most one per row), each walking rows
    strided by the grid (the CPU's interpreter counts one SM)."""
    T = logits_TV.shape[0]
    if ROWS_PER_SM <= 0:
        return T
    sms = (torch.cuda.get_device_properties(logits_TV.device).multi_processor_count
           if logits_TV.device.type == "cuda" else 1)
    return max(1, min(T, ROWS_PER_SM * sms))


class _InPlaceCrossEntropy(torch.autograd.Function):
    """The mean loss; its gradient computed in forward over the logits' buffer (the module docstring)."""

    @staticmethod
    def forward(ctx, logits_TV, targets_T, backward_scale: float):
        count = (targets_T != IGNORE_INDEX).sum().clamp(min=1).float()
        losses_T = _row_losses(logits_TV, targets_T, backward_scale / count)
        ctx.save_for_backward(logits_TV)  # now the gradient (saved after the kernel: its version is the written one)
        ctx.backward_scale = backward_scale
        return losses_T.sum() / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if getattr(ctx, "spent", False):  # retain_graph: the buffer already holds the first backward's gradient
            raise RuntimeError("backend.loss=full's in-place loss gives its gradient once (its buffer is the "
                               "logits'); a second backward through the same graph (retain_graph) is not supported: "
                               "recompute the loss, or take backend.loss=chunked")
        ctx.spent = True
        (d_TV,) = ctx.saved_tensors
        _, rescale = _kernels()
        grid = min(RESCALE_PROGRAMS, cdiv(d_TV.numel(), RESCALE_BLOCK))
        rescale[(grid,)](d_TV, grad_loss.float().contiguous(), ctx.backward_scale, d_TV.numel(),
                         BLOCK=RESCALE_BLOCK, num_warps=4)
        return d_TV, None, None


def cross_entropy_in_place(logits_TV: torch.Tensor, targets_T: torch.Tensor, backward_scale: float = 1.0):
    """The token-mean cross entropy (fp32) of `logits_TV` against `targets_T` (-100: left out). With gradients
    wanted, the logits' buffer becomes their gradient (`backward_scale`: the scale backward is expected to bring);
    without, the logits are only read. Needs ``applies(logits_TV)``."""
    if torch.is_grad_enabled() and logits_TV.requires_grad:
        if backward_scale == 0:
            raise ValueError("backward_scale must not be 0 (the scale backward is expected to bring)")
        return _InPlaceCrossEntropy.apply(logits_TV, targets_T, float(backward_scale))
    count = (targets_T != IGNORE_INDEX).sum().clamp(min=1).float()
    return _row_losses(logits_TV.detach(), targets_T, None).sum() / count
