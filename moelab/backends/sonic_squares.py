"""SonicMoE's two weight-gradient GEMMs with the squares of their outputs summed in the epilogue (issue 41).

The step's gradient norm reads every gradient once after the backward (moelab.backends.grad_norm: 3.8 ms of the
Qwen3 proxy's one-micro-batch step on an H100, 86% of it the experts' two weights). Where a step has one micro
batch, the experts' weight-gradient GEMMs write each gradient whole; here QuACK's sum-of-squares epilogue
(quack.gemm_sq_reduce's GemmSqReduceSm90: sum over each output row of D^2, per N tile, in fp32) rides on the same
GEMMs (varlen K, rows gathered by token), so the norm needs no pass over them. The squares are of the fp32 values
before their rounding to the gradient's bf16 (relative difference in the sum of order 1e-6).

Only on SM90 (Hopper), and only where the epilogue sees the gradient whole: where the GEMM writes it, or adds into
.grad by reading it as the GEMM's C operand (``add=True``: D = A @ B + D, the squares of the sum; QuACK's other add,
a TMA reduce store, forms the sum in L2, where the registers never see it). Anything else returns False and the
caller runs moelab.backends.sonic's plain GEMM.

    sq_LMT = torch.zeros(E, M, n_tiles(N, config))
    done = gemm_sq(A, B, D, cu_seqlens_k, A_idx, config, concat_layout, sq_LMT)   # D written, sq_LMT filled
    done = gemm_sq(A, B, D, cu_seqlens_k, A_idx, config, concat_layout, sq_LMT, add=True)   # D += A @ B
"""
from __future__ import annotations

import torch

ENABLED = True  # False: moelab.backends.sonic runs the plain GEMMs and the norm's pass reads these gradients (the
# gallery's A/B; also set when this path fails to compile, with a warning)


def _config(device: torch.device, config):
    from quack import gemm_interface as qi

    return config if config is not None else qi.default_config(device)


def n_tiles(n: int, device: torch.device, config=None) -> int:
    """How many N tiles the GEMM's output of width n has under `config` (QuACK's default: None)."""
    tile_n = _config(device, config).tile_n
    return -(-n // tile_n)


def _compile_sonic_dw_sq(a_dtype, b_dtype, d_dtype, c_dtype, a_major, b_major, d_major, c_major, tile_shape_mn,
                         cluster_shape_mnk, pingpong, is_dynamic_persistent, gather_A, concat_layout, device_capacity):
    """quack.gemm's default-epilogue compile with quack.gemm_sq_reduce's class and its (L, M, N-tiles) output (C:
    c_dtype None for none)."""
    from quack.compile_utils import make_fake_tensor
    from quack.gemm_sq_reduce import GemmSqReduceSm90
    from quack.gemm_tvm_ffi_utils import (compile_gemm_kernel, make_fake_gemm_tensors, make_fake_scheduler_args,
                                          make_fake_varlen_args)
    from cutlass import Float32
    import cutlass.cute as cute

    mA, mB, mD, mC, m, n, k, l = make_fake_gemm_tensors(a_dtype, b_dtype, d_dtype, c_dtype, a_major, b_major,
                                                        d_major, c_major, varlen_k=True, gather_A=gather_A)
    tiles = cute.sym_int()
    sq = make_fake_tensor(Float32, (l, m, tiles), leading_dim=2, divisibility=1)
    epi_args = GemmSqReduceSm90.EpilogueArguments(mColVecReduce=sq)
    scheduler_args = make_fake_scheduler_args(is_dynamic_persistent, False, l)
    varlen_args = make_fake_varlen_args(False, True, gather_A, k)
    return compile_gemm_kernel(GemmSqReduceSm90, a_dtype, tile_shape_mn, cluster_shape_mnk, pingpong, True, gather_A,
                               is_dynamic_persistent, device_capacity, mA, mB, mD, mC, epi_args, scheduler_args,
                               varlen_args, concat_layout=concat_layout or None)


_cached = None


def _compiled(*key):
    global _cached
    if _cached is None:
        from quack.cache_utils import jit_cache

        _cached = jit_cache(_compile_sonic_dw_sq)
    return _cached(*key)


def gemm_sq(A: torch.Tensor, B: torch.Tensor, D: torch.Tensor, cu_seqlens_k: torch.Tensor, A_idx, config,
            concat_layout: "tuple | None", sq_LMT: torch.Tensor, add: bool = False) -> bool:
    """D = A @ B (add: D = A @ B + D, D read as C) per expert (QuACK's varlen-K layout: A (M, total_K) or gathered by
    A_idx, B (total_K, N), D (E, M, N)) and sq_LMT[e, m, t] = the sum over N tile t of D[e, m, :]^2 (fp32, before
    rounding). False (nothing run) where this path does not apply: not SM90, or a config that swaps A and B (or
    gathers rows across N)."""
    from quack.cute_dsl_utils import get_device_capacity, get_max_active_clusters, torch2cute_dtype_map
    from quack.gemm_tvm_ffi_utils import get_majors, make_scheduler_args, make_varlen_args, perm3d
    from quack.gemm_sq_reduce import GemmSqReduceMixin

    capacity = get_device_capacity(A.device)
    config = _config(A.device, config)
    if capacity[0] != 9 or getattr(config, "swap_ab", False) or (A_idx is not None and config.cluster_n != 1):
        return False
    B = B.mT  # (N, total_K), as quack.gemm_interface passes it
    C = D if add else None
    A_p, B_p, D_p, C_p = perm3d(A, B, D, C, varlen_k=True)
    a_major, b_major, d_major, c_major = get_majors(A_p, B_p, D_p, C_p)
    dt = torch2cute_dtype_map
    concat = tuple(sorted(set(concat_layout or ()) | ({"C"} if add and "out" in (concat_layout or ()) else set())))
    compiled = _compiled(dt[A.dtype], dt[B.dtype], dt[D.dtype], dt[D.dtype] if add else None, a_major, b_major,
                         d_major, c_major, (config.tile_m, config.tile_n), (config.cluster_m, config.cluster_n, 1),
                         config.pingpong, config.is_dynamic_persistent, A_idx is not None, concat, capacity)
    semaphore = torch.zeros(1, dtype=torch.int32, device=A.device) if config.is_dynamic_persistent else None
    epi_args = GemmSqReduceMixin.EpilogueArguments(mColVecReduce=sq_LMT, add_to_output=None, rounding_mode=None)
    scheduler_args = make_scheduler_args(get_max_active_clusters(config.cluster_m * config.cluster_n),
                                         config.max_swizzle_size, semaphore)
    compiled(A_p, B_p, D_p, C_p, epi_args, scheduler_args, make_varlen_args(None, cu_seqlens_k, A_idx), None)
    return True
