"""The optional packages of the kernel switchboard (grouped_gemm, TE, DeepEP, SonicMoE, FlashAttention-4, and the
fused losses' Liger Kernel and cut-cross-entropy): what each is, whether it is installed, how to import it.

    detected()                   # {'grouped_gemm': False, 'te': False, 'deep_ep': False, 'liger': False, ...}
    import_package("te")         # the module, or BackendUnavailable saying how to install it

Detection runs once, at import (``importlib.util.find_spec``: cheap, imports nothing heavy); the switchboard
itself (which config asks for which package, and the hardware checks) is moelab.backends.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass

from moelab.config import ConfigError


class BackendUnavailable(ConfigError):
    """A requested backend's package is missing or unsupported here; the message says how to fix it.

        raise BackendUnavailable("the 'te' backend needs the package 'transformer-engine[pytorch]' ...")
    """


@dataclass(frozen=True)
class Package:
    """One optional package: what is imported, what is installed, how, and on which hardware it runs.

        PACKAGES["te"].install
    """
    key: str
    module: str  # what is imported
    pip: str  # what is installed
    install: str  # how to install it
    needs: str  # hardware it needs


PACKAGES = {
    "grouped_gemm": Package(
        "grouped_gemm", "grouped_gemm", "grouped_gemm",
        "pip install --no-build-isolation grouped_gemm==0.3.0 (builds CUDA kernels with nvcc; on a cluster "
        "without internet see gallery/scripts/build_backends.sh)", "a CUDA GPU (sm80+)"),
    "te": Package(
        "te", "transformer_engine.pytorch", "transformer-engine[pytorch]",
        "pip install --no-build-isolation 'transformer-engine[pytorch]' (or the transformer-engine-cu12/cu13 "
        "wheel matching your CUDA)", "a CUDA GPU (sm80+)"),
    "deep_ep": Package(
        "deep_ep", "deep_ep", "deep-ep",
        "build DeepEP from its source repository (github.com/deepseek-ai/DeepEP at its last 1.x commit; on a "
        "machine without network: gallery/scripts/deepep/prepare.sh packs the source, build.sh builds the wheel "
        "there and installs it (README there); the PyPI sdist of deep-ep 1.0.0 lacks its headers)",
        "CUDA GPUs of compute capability 9.0 (Hopper) linked by NVLink, and parallel.ep > 1"),
    "liger": Package(
        "liger", "liger_kernel", "liger-kernel",
        "pip install liger-kernel (or pip install 'moelab[loss]'; Triton kernels)", "a CUDA GPU"),
    "cce": Package(
        "cce", "cut_cross_entropy", "cut-cross-entropy",
        "pip install cut-cross-entropy (or pip install 'moelab[loss]'; Triton kernels)", "a CUDA GPU"),
    "triton": Package(
        "triton", "triton", "triton",
        "pip install triton (torch's Linux CUDA wheels bring it); moelab's fused experts kernels are its own "
        "(moelab.model.fused_experts)", "a CUDA GPU (sm80+)"),
    "sonic": Package(
        "sonic", "sonicmoe", "sonic-moe",
        "pip install --no-deps sonic-moe==0.1.2.post1 quack-kernels==0.3.11 nvidia-cutlass-dsl==4.4.2 "
        "nvidia-cutlass-dsl-libs-cu13==4.4.2 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 (the pins of "
        "moelab[sonic]; --no-deps because sonic-moe declares torch<=2.9.1, and it runs on torch 2.11; a machine "
        "without network: gallery/scripts/sonic_site.sh)", "a Hopper or newer CUDA GPU (sm90+)"),
    "fa4": Package(
        "fa4", "flash_attn.cute", "flash-attn-4",
        "pip install --no-deps flash-attn-4==4.0.0b10, next to moelab[sonic]'s pins (the last FA4 release on "
        "QuACK 0.3 and CUTLASS DSL 4.4.2, which it needs; or pip install 'moelab[fa4]' with them)",
        "a Hopper or Blackwell CUDA GPU (sm90 / sm100)"),
}

def _find(module: str) -> bool:
    try:
        # the top-level package only: finding a submodule would import its parent
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _installed(p: Package) -> bool:
    if p.key == "fa4":  # flash-attn (FlashAttention-2) installs the same top-level package, without flash_attn.cute
        try:
            importlib.metadata.distribution(p.pip)
        except importlib.metadata.PackageNotFoundError:
            return False
    return _find(p.module)


_DETECTED = {key: _installed(p) for key, p in PACKAGES.items()}  # read-only after import


def detected() -> dict[str, bool]:
    """Which optional packages are installed (detected at import time)."""
    return dict(_DETECTED)


def import_package(key: str):
    """Import a backend package, or raise BackendUnavailable naming it and how to install it."""
    p = PACKAGES[key]
    if not _DETECTED[key]:
        raise BackendUnavailable(f"the '{key}' backend needs the package {p.pip!r}, which is not installed. "
                                 f"Install: {p.install}. Or set backend.fallback=true to use the torch path.")
    try:
        return importlib.import_module(p.module)
    except Exception as e:  # installed but broken (wrong CUDA/torch ABI): say so, with the original error
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:  # the innermost error names the cause
            cause = cause.__cause__ or cause.__context__
        detail = f"{type(e).__name__}: {e}" + (f"; caused by {type(cause).__name__}: {cause}" if cause is not e else "")
        raise BackendUnavailable(f"the '{key}' backend's package {p.pip!r} is installed but {p.module} does not "
                                 f"import ({detail}). Reinstall it for this torch/CUDA: {p.install}") from e
