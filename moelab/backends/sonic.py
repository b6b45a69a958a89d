"""backend.experts=sonic: SonicMoE's experts (Dao-AILab/sonic-moe on QuACK's CuTe-DSL grouped GEMMs) on the tokens
themselves: the routed rows gathered inside the first grouped GEMM, SwiGLU and its backward in the GEMMs' epilogues,
the weighted combine read straight from the down projection's rows, the minimal activations kept for backward, and
on a later micro batch the expert weights' gradients added into their .grad by the weight-gradient GEMMs (QuACK's
add-to-output epilogue: no separate `.grad +=` pass over the experts' weights).

    sonic_layout(experts)                                       # once, before the weights are materialised
    y_TD = sonic_experts(x_TD, weights_TK, experts_TK, w_gate_up_EDF2, w_down_EFD)

Shapes: T tokens, K experts per token, N = T*K routed rows (grouped by expert), E experts, D hidden, F expert width.
SonicMoE keeps expert weights as [out, in] (its [E, 2F, D] gate|up, [E, D, F] down, contiguous); moelab's are
[E, D, 2F] / [E, F, D]. ``sonic_layout`` stores moelab's parameters with SonicMoE's memory order (same shapes and
values, transposed strides), so each call hands SonicMoE a view, no copy; weights in another order (e.g. after
FSDP's resharding) are copied into SonicMoE's order each call, correct but slower, and their gradients go through
autograd. The layer is moelab's own autograd Function over SonicMoE's routing metadata and combine kernels and
QuACK's six grouped GEMMs (GEMMS), each called below QuACK's custom-op and autotuning wrappers (one Python layer per
GEMM: the host launches a one-micro-batch step's kernels ahead of the GPU) with moelab's tile for that GEMM
(TILES, measured at the Qwen3-30B-A3B proxy's shapes by gallery/scripts/gpu_sonic_tiles.py; QuACK's default config
where the table has none; QuACK's own autotuner compiles 30+ CuTe-DSL configs per GEMM on a first call, over 400 s
in issue 41 call 4). Its kernels cannot be traced by torch.compile: the call is a graph break.
"""
from __future__ import annotations

import functools
import json
import os
import warnings

import torch
from torch import nn

from moelab.backends.grad_norm import record_squares, wants_squares
from moelab.backends.ops import accumulates_into
from moelab.backends.packages import import_package
from moelab.backends import sonic_squares

GEMMS = ("up", "down", "down_dact", "up_dx", "up_dw", "down_dw")
"""The layer's grouped GEMMs: up (the gathered rows @ w_gate_up, SwiGLU in the epilogue), down (a @ w_down),
down_dact (the gathered output gradient @ w_down^T, SwiGLU's backward and the routing weights' gradient in the
epilogue), up_dx (dh @ w_gate_up^T), up_dw and down_dw (the weights' gradients, summed over each expert's rows)."""

TILE_FIELDS = ("tile_m", "tile_n", "pingpong", "cluster_m", "cluster_n", "is_dynamic_persistent")
TILES: dict[int, dict[str, tuple]] = {9: {  # gallery/results/*--moelab--sonic-tiles-*-issue41-call1[4-8].json
    "up": (128, 256, False, 2, 1, False),  # skewed routing 0.85-0.95x QuACK's default's time, balanced 1.02-1.03x
    "down_dact": (128, 256, False, 2, 1, False)}}  # 0.64-0.90x skewed, 0.71-0.94x balanced
"""GPU compute capability (major) -> GEMM -> its QuACK tile (TILE_FIELDS); a GEMM not named runs QuACK's default
config (on sm90: 128 x 192, pingpong, clusters of 2 x 1). The gated GEMMs take QuACK's cooperative 128 x 256 tile,
from the sweeps of gallery/scripts/gpu_sonic_tiles.py (H100 and H200, the Qwen3 proxy's and DeepSeek-V3's shapes):
with both, the whole layer ran 0.90 / 0.94x QuACK's defaults' time at the Qwen3 proxy's skewed / balanced routing
and 0.92 / 1.00x at DeepSeek-V3's (issue 41 call 18, one H100). The other GEMMs' best tiles changed from sweep to
sweep by as much as they beat the default, and the layer with them ran slower than QuACK's defaults at balanced
routing (calls 15-16): they keep the default. 64-row pingpong tiles (less padding in each expert's last tile) ran
only down_dact faster, 7%, and the step with the sweep's choice within its spread (call 39): not taken."""


@functools.cache
def _sonic():
    """sonicmoe, imported (or BackendUnavailable naming the install line)."""
    return import_package("sonic")


@functools.cache
def _quack():
    """QuACK's GEMM entry points below their custom ops and autotuners (quack.gemm_interface's *_tuned.fn): each
    takes the tile as `config` (None: QuACK's default)."""
    _sonic()
    from quack import gemm_interface as qi

    return qi.gemm_tuned.fn, qi.gemm_gated_tuned.fn, qi.gemm_dgated_tuned.fn


ROWS_ONCE: frozenset[str] = frozenset()
"""The backward GEMMs whose A operand (the output gradient's or the input's rows, by token) is copied into grouped
order once (index_select) and read in place, where the others gather it inside the GEMM (cp.async loads, clusters
of one along N, the static scheduler)."""


def rows_once() -> frozenset[str]:
    """ROWS_ONCE, or the GEMMs named by MOELAB_SONIC_ROWS_ONCE (comma-separated: a measurement's variant)."""
    env = os.environ.get("MOELAB_SONIC_ROWS_ONCE")
    if env is None:
        return ROWS_ONCE
    chosen = frozenset(g for g in env.split(",") if g)
    if not chosen <= {"down_dact", "up_dw", "down_dw"}:
        raise ValueError(f"MOELAB_SONIC_ROWS_ONCE={env}: the GEMMs that gather rows in backward are down_dact, "
                         f"up_dw and down_dw")
    return chosen


ADD_VIA = "reduce"
"""How a later micro batch's two weight-gradient GEMMs add into .grad: "reduce", QuACK's add-to-output epilogue (a
TMA reduce-add store: the sum formed in L2, rounded twice); "load", .grad read as the GEMM's C operand and acc + C
stored (one rounding; the epilogue sees the final gradient, so its squares can be summed there for the step's norm,
as a written one's are); "squares", the reduce store except where the step's norm wants the final gradient's squares
(its last micro batch), there the load with the squares (issue 41 call 45: the load alone is no faster)."""
ADDS = ("reduce", "load", "squares")


def add_via() -> str:
    """ADD_VIA, or MOELAB_SONIC_ADD (one of ADDS: a measurement's variant, gallery/scripts/gpu_wgrad.py)."""
    env = os.environ.get("MOELAB_SONIC_ADD")
    if env is None:
        return ADD_VIA
    if env not in ADDS:
        raise ValueError(f"MOELAB_SONIC_ADD={env}: the weight-gradient GEMMs add into .grad by 'reduce' (QuACK's "
                         f"TMA reduce store), 'load' (.grad read as C) or 'squares' (the load where the norm wants "
                         f"the squares, else the reduce store)")
    return env


def tiles_for(major: int) -> dict[str, tuple]:
    """GEMM -> its tile (TILE_FIELDS) on a GPU of this compute capability: TILES, with the entries of
    MOELAB_SONIC_TILES (a JSON file {GEMM: [TILE_FIELDS...]}) in place of the table's: a measurement's candidates
    (gallery/scripts/gpu_sonic_tiles.py), not a setting."""
    chosen = dict(TILES.get(major, {}))
    if os.environ.get("MOELAB_SONIC_TILES"):
        with open(os.environ["MOELAB_SONIC_TILES"]) as f:
            chosen.update({g: tuple(t) for g, t in json.load(f).items()})
    for g, t in chosen.items():
        if g not in GEMMS or len(t) != len(TILE_FIELDS):
            raise ValueError(f"SonicMoE tile {g}={list(t)}: the GEMMs are {GEMMS}, each tile {TILE_FIELDS}")
    return chosen


@functools.cache
def tile_configs(major: int) -> dict:
    """GEMM -> QuACK GemmConfig (None: QuACK's default) on a GPU of this compute capability (tiles_for)."""
    from quack.gemm_config import GemmConfig

    chosen = tiles_for(major)
    return {g: GemmConfig(**dict(zip(TILE_FIELDS, chosen[g])), device_capacity=major) if g in chosen else None
            for g in GEMMS}


def _configs(device: torch.device) -> dict:
    return tile_configs(torch.cuda.get_device_capability(device)[0])


# The six GEMMs (w1 = w_gate_up_EDF2 and w2 = w_down_EFD in SonicMoE's memory order; offsets_E1: each expert's first
# grouped row; gather_N: each grouped row's token). Gate|up halves: w1 and dw1 hold them concatenated along 2F, the
# GEMMs' h / dh rows interleaved (QuACK's concat_layout).
def gemm_up(x_TD, w1, h_NF2, a_NF, offsets_E1, gather_N, config=None) -> None:
    """h = x[gather] @ w1 per expert, a = SwiGLU(h)."""
    _quack()[1](x_TD, w1, h_NF2, a_NF, None, None, "swiglu", offsets_E1, gather_N, False, config=config,
                concat_layout=("B",))


def gemm_down(a_NF, w2, y_ND, offsets_E1, config=None) -> None:
    """y = a @ w2 per expert."""
    _quack()[0](a_NF, w2, y_ND, cu_seqlens_m=offsets_E1, config=config)


def gemm_down_dact(g_TD, w2, h_NF2, dh_NF2, a_NF, s_N, offsets_E1, gather_N, config=None) -> torch.Tensor:
    """da = g[gather] @ w2^T per expert (gather_N None: g's rows are the grouped rows already); dh = SwiGLU's
    backward of (s * da) at h, a = SwiGLU(h) recomputed; returns each grouped row's sum of da * a (the routing
    weight's gradient), fp32."""
    return _quack()[2](g_TD, w2.transpose(1, 2), h_NF2, dh_NF2, a_NF, s_N, "swiglu", True, offsets_E1, gather_N,
                       False, config=config)


def gemm_up_dx(dh_NF2, w1, dx_ND, offsets_E1, config=None) -> None:
    """dx (per grouped row) = dh @ w1^T per expert."""
    _quack()[0](dh_NF2, w1.transpose(1, 2), dx_ND, cu_seqlens_m=offsets_E1, config=config, concat_layout=("B",))


def _dw(A, B, D, offsets_E1, gather_N, add: bool, config, concat_layout, squares_of) -> None:
    """D (+)= A @ B per expert (QuACK's varlen-K GEMM; an add by add_via()). `squares_of`: the weight whose final
    gradient D is (written whole, or summed in the epilogue by the load): the sum of D's squares is recorded for the
    step's gradient norm (moelab.backends.grad_norm) by the same GEMM's epilogue where moelab.backends.sonic_squares
    applies."""
    via = add_via()
    load = add and (via == "load" or (via == "squares" and squares_of is not None and sonic_squares.ENABLED))
    if squares_of is not None and (load or not add) and sonic_squares.ENABLED:
        tiles = sonic_squares.n_tiles(D.shape[2], D.device, config)
        sq_LMT = torch.zeros(D.shape[0], D.shape[1], tiles, dtype=torch.float32, device=D.device)
        try:
            done = sonic_squares.gemm_sq(A, B, D, offsets_E1, gather_N, config, concat_layout, sq_LMT, add=load)
        except Exception as e:  # noqa: BLE001 - QuACK's compile of the epilogue: the plain GEMM and the norm's pass
            sonic_squares.ENABLED = False
            warnings.warn(f"moelab.backends.sonic_squares is off for this process ({type(e).__name__}: {e}); the "
                          "gradient norm reads the experts' gradients in its own pass")
            done = False
        if done:
            record_squares(squares_of, sq_LMT.sum())
            return
    if load:  # D read as C (one rounding of the sum); the interleaved gate|up layout applies to it as to D
        _quack()[0](A, B, D, D, cu_seqlens_k=offsets_E1, A_idx=gather_N, config=config,
                    concat_layout=concat_layout and concat_layout + ("C",))
        return
    _quack()[0](A, B, D, cu_seqlens_k=offsets_E1, A_idx=gather_N, add_to_output=add, config=config,
                concat_layout=concat_layout)


def gemm_up_dw(x_TD, dh_NF2, dw1, offsets_E1, gather_N, add: bool, config=None, squares_of=None) -> None:
    """dw1 (+)= x[gather]^T @ dh per expert (gather_N None: x's rows are the grouped rows already)."""
    _dw(x_TD.T, dh_NF2, dw1, offsets_E1, gather_N, add, config, ("out",), squares_of)


def gemm_down_dw(g_TD, a_NF, dw2, offsets_E1, gather_N, add: bool, config=None, squares_of=None) -> None:
    """dw2 (+)= (g[gather]^T @ a)^T per expert (written through dw2's transpose; gather_N None: g's rows are the
    grouped rows already)."""
    _dw(g_TD.T, a_NF, dw2.transpose(1, 2), offsets_E1, gather_N, add, config, None, squares_of)


def sonic_layout(experts) -> None:
    """Store a GroupedExperts' two weights in SonicMoE's memory order ([E, 2F, D] and [E, D, F] contiguous, seen
    as moelab's [E, D, 2F] and [E, F, D]); values kept (a meta module stays meta: materialising keeps strides)."""
    for name in ("w_gate_up_EDF2", "w_down_EFD"):
        p = getattr(experts, name)
        store = torch.empty(p.shape[0], p.shape[2], p.shape[1], dtype=p.dtype, device=p.device).transpose(1, 2)
        if p.device.type != "meta":
            store.copy_(p.detach())
        setattr(experts, name, nn.Parameter(store, requires_grad=p.requires_grad))


def in_sonic_order(w: torch.Tensor) -> torch.Tensor:
    """w ([E, D, 2F] or [E, F, D]) with SonicMoE's memory order: w itself where it has it, else a copy."""
    return w if w.transpose(1, 2).is_contiguous() else w.transpose(1, 2).contiguous().transpose(1, 2)


def weight_grad_buffers(w_gate_up_EDF2: torch.Tensor, w_down_EFD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                         bool]:
    """Where backward writes the two weights' gradients: into their own .grad when both accumulate there
    (moelab.backends.ops.accumulates_into: a later micro batch, eager, no hooks) and both are in SonicMoE's order,
    returning True; else into new tensors in SonicMoE's order (moelab's shapes), returning False."""
    weights = (w_gate_up_EDF2, w_down_EFD)
    if all(accumulates_into(w) and w.transpose(1, 2).is_contiguous() for w in weights):
        return w_gate_up_EDF2.grad, w_down_EFD.grad, True
    dw1, dw2 = (torch.empty(w.shape[0], w.shape[2], w.shape[1], dtype=w.dtype, device=w.device).transpose(1, 2)
                for w in weights)
    return dw1, dw2, False


class _SonicExperts(torch.autograd.Function):
    """SonicMoE's routing metadata and combine with the six GEMMs above, forward and backward; the weight-gradient
    GEMMs write into .grad or add to it (weight_grad_buffers)."""

    @staticmethod
    def forward(ctx, x_TD, scores_N, experts_TK, w_gate_up_EDF2, w_down_EFD):
        from sonicmoe.functional.reduction_over_k_gather import token_gather_and_sum_varlen_K_triton
        from sonicmoe.functional.triton_kernels import TC_topk_router_metadata_triton

        (T, D), (_, K), E = x_TD.shape, experts_TK.shape, w_gate_up_EDF2.shape[0]
        F, N, dev, cfg = w_down_EFD.shape[1], T * K, x_TD.device, _configs(x_TD.device)
        offsets_E1 = torch.empty(E + 1, dtype=torch.int32, device=dev)  # each expert's first grouped row
        gather_N, scatter_N, reverse_N = (torch.empty(N, dtype=torch.int32, device=dev) for _ in range(3))
        TC_topk_router_metadata_triton(experts_TK.int().contiguous(), E, torch.empty(E, dtype=torch.int32, device=dev),
                                       offsets_E1, gather_N, scatter_N, reverse_N)
        w1, w2 = in_sonic_order(w_gate_up_EDF2), in_sonic_order(w_down_EFD)
        h_NF2, a_NF, y_ND, out_TD = (x_TD.new_empty(N, 2 * F), x_TD.new_empty(N, F), x_TD.new_empty(N, D),
                                     x_TD.new_empty(T, D))
        gemm_up(x_TD, w1, h_NF2, a_NF, offsets_E1, gather_N, cfg["up"])
        gemm_down(a_NF, w2, y_ND, offsets_E1, cfg["down"])
        token_gather_and_sum_varlen_K_triton(y_ND, scores_N, out_TD, reverse_N, None, T, K, D, False)
        ctx.save_for_backward(x_TD, h_NF2, scores_N, w_gate_up_EDF2, w_down_EFD, offsets_E1, gather_N, scatter_N,
                              reverse_N)
        ctx.K = K
        return out_TD

    @staticmethod
    def backward(ctx, g_TD):
        from sonicmoe.functional.reduction_over_k_gather import token_gather_and_sum_varlen_K_triton

        x_TD, h_NF2, scores_N, w_gate_up_EDF2, w_down_EFD, offsets_E1, gather_N, scatter_N, reverse_N = \
            ctx.saved_tensors
        (T, D), N, F, cfg = x_TD.shape, h_NF2.shape[0], h_NF2.shape[1] // 2, _configs(x_TD.device)
        g_TD = g_TD.to(x_TD.dtype).contiguous()
        w1, w2 = in_sonic_order(w_gate_up_EDF2), in_sonic_order(w_down_EFD)
        dh_NF2, a_NF, dscores_N = torch.empty_like(h_NF2), x_TD.new_empty(N, F), torch.empty_like(scores_N)
        rows = rows_once()
        g_rows = g_TD.index_select(0, gather_N) if rows & {"down_dact", "down_dw"} else None

        def operand(gemm, t_TD, t_rows):  # (A, its gather): the grouped rows copied once, or gathered by the GEMM
            return (t_rows, None) if gemm in rows else (t_TD, gather_N)
        g_A, g_idx = operand("down_dact", g_TD, g_rows)
        dscores_N[scatter_N] = gemm_down_dact(g_A, w2, h_NF2, dh_NF2, a_NF, scores_N[scatter_N], offsets_E1, g_idx,
                                              cfg["down_dact"])
        dx_ND = x_TD.new_empty(N, D)
        gemm_up_dx(dh_NF2, w1, dx_ND, offsets_E1, cfg["up_dx"])
        dw1_EDF2, dw2_EFD, accumulate = weight_grad_buffers(w_gate_up_EDF2, w_down_EFD)
        adds = accumulate and add_via() != "reduce"  # the epilogue sees the sum: its squares are the final gradient's
        sq1, sq2 = (w if wants_squares(w, adds) else None for w in (w_gate_up_EDF2, w_down_EFD))  # for the norm
        x_A, x_idx = operand("up_dw", x_TD, x_TD.index_select(0, gather_N) if "up_dw" in rows else None)
        gemm_up_dw(x_A, dh_NF2, dw1_EDF2, offsets_E1, x_idx, accumulate, cfg["up_dw"], sq1)
        del x_A
        g_A, g_idx = operand("down_dw", g_TD, g_rows)
        gemm_down_dw(g_A, a_NF, dw2_EFD, offsets_E1, g_idx, accumulate, cfg["down_dw"], sq2)
        dx_TD = torch.empty_like(x_TD)
        token_gather_and_sum_varlen_K_triton(dx_ND, None, dx_TD, reverse_N, None, T, ctx.K, D, False)
        return dx_TD, dscores_N, None, *((None, None) if accumulate else (dw1_EDF2, dw2_EFD))


@torch.compiler.disable
def sonic_experts(x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor,
                  w_gate_up_EDF2: torch.Tensor, w_down_EFD: torch.Tensor) -> torch.Tensor:
    """y_TD = sum over each token's K experts of weight * SwiGLU expert(x), by SonicMoE's kernels (bf16 tokens and
    weights; weights_TK fp32, as the router gives them)."""
    _sonic()
    y_TD = _SonicExperts.apply(x_TD.contiguous(), weights_TK.float().reshape(-1).contiguous(), experts_TK,
                               w_gate_up_EDF2, w_down_EFD)
    return y_TD
