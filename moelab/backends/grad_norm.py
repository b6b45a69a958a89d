"""The gradients' squared norms with one Triton pass per large CUDA gradient (the step's gradient norm:
moelab.parallel.place's and moelab.parallel.distributed's clip_grad_norm). torch's `_foreach_norm` read the Qwen3
proxy's 11 GB of bf16 gradients at 2.1 TB/s on an H100 and 2.4 on an H200 (5.3 / 4.7 ms a step: issue 41 calls
13-14's profiles, its LpNorm kernel); this kernel reads each gradient once with wide loads, each program adding its
block's squares in fp32 into a slot of its own (no atomics, no host sync), and one sum per gradient at the end.
The other gradients (below MIN_NUMEL elements, not dense, not on a kernel device) take torch's `_foreach_norm`.

    sq_G = squared_norms(grads)        # fp32, one per gradient: sum of g**2 over its elements
    total = squared_norms(grads).sum().sqrt()

A backward that writes a gradient whole may sum its squares on the way (moelab.backends.sonic_squares: SonicMoE's
weight-gradient GEMMs, in their epilogue) during the step's last micro batch (``squares_in_backward``, the trainer's);
``param_squared_norms`` then takes those sums and reads only the other gradients.

    with squares_in_backward(True):
        loss.backward()
    total = param_squared_norms(params).sum().sqrt()

Every gradient counts in fp32: torch's foreach norm of bf16 gradients rounds each gradient's norm to bf16 first.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from moelab.backends.flat import cdiv, dense, kernel_devices, triton_available

MIN_NUMEL = 1 << 20
BLOCK, ITERS = 4096, 8  # one program: ITERS blocks of BLOCK elements


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sumsq_kernel(g_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            g = tl.load(g_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc += g * g
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return sumsq_kernel


def on_kernel(g: torch.Tensor) -> bool:
    """Whether g's squares are summed by the kernel: large, dense (any dimension order: its span walked flat) and
    on a kernel device (CUDA; the CPU under Triton's interpreter)."""
    return g.device.type in kernel_devices() and g.numel() >= MIN_NUMEL and dense(g) and triton_available()


def squared_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """fp32 [len(grads)]: each gradient's sum of squares, on the first gradient's device. No host-to-device copy
    (a pageable one would wait for the queued backward): the kernel's gradients write into rows of one zeroed
    [gradients, most programs] buffer, summed per row."""
    if not grads:
        return torch.zeros(0)
    dev = grads[0].device
    kernel = [on_kernel(g) for g in grads]
    big = [g for g, k in zip(grads, kernel) if k]
    rest = [g for g, k in zip(grads, kernel) if not k]
    rest_sq = torch.stack([n.float().to(dev) for n in torch._foreach_norm(rest)]).square() if rest else None
    if big:
        grids = [cdiv(g.numel(), BLOCK * ITERS) for g in big]
        partial = torch.zeros(len(big), max(grids), dtype=torch.float32, device=dev)
        for row, (g, grid) in enumerate(zip(big, grids)):
            _kernel()[(grid,)](g, partial[row], g.numel(), BLOCK=BLOCK, ITERS=ITERS, num_warps=8)
        big_sq = partial.sum(1)
    b = r = 0
    order = []
    for k in kernel:  # each gradient's own slot, in the given order (views: no kernel until the stack)
        order.append(big_sq[b] if k else rest_sq[r])
        b, r = b + k, r + (not k)
    return torch.stack(order)


_collecting = False
_recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(parameter) -> (parameter, its gradient's sum)


@contextlib.contextmanager
def squares_in_backward(on: bool):
    """While on, a backward that writes a plain parameter's gradient whole may record its sum of squares
    (``record_squares``): the trainer turns it on for the step's last micro batch."""
    global _collecting
    was, _collecting = _collecting, on
    try:
        yield
    finally:
        _collecting = was


def wants_squares(w: torch.Tensor, adds_in_epilogue: bool = False) -> bool:
    """Whether the backward now making w's gradient should sum its squares: inside ``squares_in_backward``, w a
    parameter of one process (no process group: its gradient is then reduced or resharded after), no hooks that
    would change the gradient after it is made, and the backward's value the final gradient: written whole (no
    .grad yet), or `adds_in_epilogue` (its kernel adds .grad in registers and stores the sum)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (_collecting and type(w) is torch.nn.Parameter and (w.grad is None or adds_in_epilogue)
            and not distributed and not w._backward_hooks and not getattr(w, "_post_accumulate_grad_hooks", None))


def record_squares(w: torch.Tensor, sq: torch.Tensor) -> None:
    """w's gradient of this backward has the sum of squares sq (fp32, 0-d, on w's device)."""
    _recorded[id(w)] = (w, sq)


def param_squared_norms(params: list[torch.Tensor]) -> torch.Tensor:
    """fp32 [len(params)]: each parameter's gradient's sum of squares: the backward's recorded sum where it made
    one this step, else ``squared_norms``. Consumes the records (a later step records anew)."""
    recorded = {i: _recorded[id(p)][1] for i, p in enumerate(params)
                if id(p) in _recorded and _recorded[id(p)][0] is p}
    _recorded.clear()
    if not recorded:
        return squared_norms([p.grad for p in params])
    rest = [i for i in range(len(params)) if i not in recorded]
    rest_sq = squared_norms([params[i].grad for i in rest]) if rest else None
    where = {i: j for j, i in enumerate(rest)}
    return torch.stack([recorded[i].float() if i in recorded else rest_sq[where[i]] for i in range(len(params))])


def scale_grads(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Clipping's multiply, in place: each gradient times the 0-d factor `coef`, one foreach multiply per (device,
    dtype), with torch.nn.utils.clip_grads_with_norm_'s values on each device. On CUDA torch rounds an fp32 factor
    to a bf16 / fp16 gradient's dtype before multiplying; the factor is handed over in that dtype, which keeps the
    multiply on torch's fast foreach path (an fp32 factor beside bf16 gradients sent it tensor by tensor: 1.04 TB/s
    on an H100, issue 41 call 41's clip check). On the CPU torch multiplies by the fp32 factor itself, and so does
    this."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), group in groups.items():
        torch._foreach_mul_(group, coef.to(device=device, dtype=dtype) if device.type == "cuda" else coef.to(device))
