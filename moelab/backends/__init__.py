"""The kernel switchboard's optional packages: grouped_gemm, Transformer Engine, SonicMoE, FlashAttention-4 and DeepEP,
behind guards.

Each package is detected when this module is imported (``importlib.util.find_spec``: cheap, imports nothing
heavy). Asking for one that is missing, or that cannot run on this hardware, raises ``BackendUnavailable`` (a
ConfigError) naming the package and how to install it; with ``backend.fallback: true`` the torch path is used
instead and a warning says so. Nothing falls back silently.

    from moelab.backends import detected, check_backends
    detected()                          # {'grouped_gemm': False, 'te': False, 'deep_ep': False, ...}
    check_backends(cfg, device="cuda")  # the effective choices, e.g. {'experts': 'grouped_gemm', ...}

What each backend replaces (the rest of the model is untouched):
    backend.experts=grouped_gemm   GroupedExperts computes with grouped_gemm.ops.gmm (moelab.backends.gmm)
    backend.experts=te             experts become TE GroupedLinear layers (moelab.backends.te)
    backend.experts=triton_fused   moelab's own Triton kernels read the routed rows from the tokens and write them
                                   back weighted, SwiGLU in the GEMMs (moelab.model.fused_experts); one GPU's
                                   local experts without capacity drops, LoRA or FP8
    backend.experts=sonic          SonicMoE's CuTe-DSL kernels on the tokens, as triton_fused (moelab.backends.sonic;
                                   optional package, Hopper+); `auto` takes it where it is installed and applies
                                   (``auto_experts``), else torch's grouped GEMM
    backend.attention=te           TE DotProductAttention, TE Linear projections and TE RMSNorm
    backend.attention=fa4          FlashAttention-4's kernels for causal attention (moelab.backends.fa4; optional
                                   package, Hopper / Blackwell); `auto` takes it where it is installed and applies
                                   (``auto_attention``), else torch's SDPA
    backend.dispatcher=deepep      DeepEP intranode dispatch/combine for expert parallelism (moelab.parallel.deepep)
    backend.loss=liger | cce       the LM head + loss as Liger Kernel's / cut-cross-entropy's fused kernel
                                   (moelab.backends.loss; the default `chunked` is moelab's own, no package)
"""
from __future__ import annotations

import warnings

from moelab.backends.packages import _DETECTED, PACKAGES, BackendUnavailable, detected, import_package  # noqa: F401
from moelab.config import Config


# Which config value asks for which package: (config field, value) -> package key.
REQUESTS = {("experts", "grouped_gemm"): "grouped_gemm", ("experts", "te"): "te", ("attention", "te"): "te",
            ("experts", "triton_fused"): "triton", ("experts", "sonic"): "sonic",
            ("dispatcher", "deepep"): "deep_ep", ("loss", "liger"): "liger", ("loss", "cce"): "cce",
            ("attention", "fa4"): "fa4"}
TORCH_PATH = {"experts": "auto", "attention": "sdpa", "dispatcher": "all_to_all", "loss": "chunked"}


def unsupported_reason(key: str, cfg: Config, device: str, world_size: int = 1) -> str | None:
    """Why a backend cannot run here (None when it can). Hardware checks only; packages are checked apart."""
    import torch

    p = PACKAGES[key]
    moe = cfg.model.moe
    on_tokens = key in ("triton", "sonic")  # kernels that gather from and scatter to this rank's tokens
    grouped_experts = key in ("grouped_gemm", "triton", "sonic") or (key == "te" and cfg.backend.experts == "te")
    act = cfg.model.hidden_act
    if grouped_experts and (moe.expert_proj_bias or moe.activation != "swiglu" or act not in ("silu", "swish")):
        # Their grouped GEMMs compute plain SwiGLU experts: biases or GPT-OSS's clamped SwiGLU would be dropped.
        return ("its grouped GEMM computes plain SwiGLU experts without biases, and this model has "
                f"model.moe.expert_proj_bias={moe.expert_proj_bias}, model.moe.activation={moe.activation!r}, "
                f"model.hidden_act={act!r}; use backend.experts=auto")
    if on_tokens:  # the fused kernels gather from and scatter to this rank's own tokens, every row kept
        if cfg.parallel.ep > 1 or moe.capacity_factor or moe.dynamic_capacity:
            return ("its kernels read each routed row from its token on this rank, every assignment kept, and this "
                    f"run has parallel.ep={cfg.parallel.ep}, model.moe.capacity_factor={moe.capacity_factor}, "
                    f"dynamic_capacity={moe.dynamic_capacity}; use backend.experts=auto")
    m = cfg.model
    if key == "fa4" and (m.attention == "mla" or cfg.parallel.cp > 1 or m.head_dim not in FA4_HEAD_DIMS):
        return ("its kernels run GQA / MHA layers' causal attention whole on one rank, with the head dims measured, "
                f"and this run has model.attention={m.attention!r}, parallel.cp={cfg.parallel.cp}, "
                f"model.head_dim={m.head_dim} (taken: {list(FA4_HEAD_DIMS)}); use backend.attention=sdpa")
    if not device.startswith("cuda"):
        return f"it needs {p.needs}, and this run is on {device!r}"
    major, minor = torch.cuda.get_device_capability(device)
    if key == "fa4" and major not in (9, 10):
        return f"it needs {p.needs}; this GPU is sm{major}{minor}"
    if key in ("grouped_gemm", "te", "triton", "sonic") and major < (9 if key == "sonic" else 8):
        return f"it needs {p.needs}; this GPU is sm{major}{minor}"
    if key in ("grouped_gemm", "te", "triton", "sonic", "fa4") and cfg.train.dtype != "bfloat16":
        return "its kernels run in bf16; set train.dtype=bfloat16"
    if key == "deep_ep":
        if major != 9:
            return f"DeepEP's intranode kernels need {p.needs}; this GPU is sm{major}{minor}"
        if cfg.parallel.ep < 2 or world_size < 2:
            return "it exchanges tokens between EP ranks; with parallel.ep=1 there is nothing to dispatch"
    return None


def check_packages(cfg: Config) -> None:
    """Refuse (BackendUnavailable, with the install hint) a backend the config asks for whose package is not
    installed on this machine: moelab.train.preflight calls it where the ranks will run here, before anything is
    submitted. With backend.fallback=true the ranks fall back to the torch path instead (check_backends)."""
    if cfg.backend.fallback:
        return
    b = cfg.backend
    for (field_name, value), key in REQUESTS.items():
        if getattr(b, field_name) == value and not _DETECTED[key]:
            raise BackendUnavailable(_unavailable(field_name, value, _missing(key)))


def _missing(key: str) -> str:
    p = PACKAGES[key]
    return f"the package {p.pip!r} is not installed (install: {p.install})"


def _unavailable(field_name: str, value: str, problem: str) -> str:
    return (f"backend.{field_name}={value!r}: {problem}. Set backend.{field_name}={TORCH_PATH[field_name]!r} for the "
            f"torch path, or backend.fallback=true to fall back to it with a warning.")


def check_backends(cfg: Config, device: str = "cpu", world_size: int = 1) -> dict[str, str]:
    """The effective switchboard for a run: each requested backend if installed and supported; otherwise raise
    BackendUnavailable, or, with backend.fallback=true, the torch path with a warning."""
    b = cfg.backend
    chosen = {"experts": b.experts, "attention": b.attention, "dispatcher": b.dispatcher, "loss": b.loss}
    if b.loss == "auto":  # the compiled full loss where it is faster and fits this GPU, else the chunked one
        chosen["loss"] = _auto_loss(cfg, device, world_size)
    if b.experts == "auto":
        chosen["experts"] = auto_experts(cfg, device, world_size)
    if b.attention == "auto":
        chosen["attention"] = auto_attention(cfg, device, world_size)
    for (field_name, value), key in REQUESTS.items():
        if chosen[field_name] != value:
            continue
        problem = None if _DETECTED[key] else _missing(key)
        problem = problem or unsupported_reason(key, cfg, device, world_size)
        if problem is None:
            continue
        fix = f"backend.{field_name}={TORCH_PATH[field_name]!r}"
        if not b.fallback:
            raise BackendUnavailable(_unavailable(field_name, value, problem))
        warnings.warn(f"backend.{field_name}={value!r} unavailable ({problem}); falling back to {fix} "
                      f"because backend.fallback=true", RuntimeWarning, stacklevel=2)
        chosen[field_name] = TORCH_PATH[field_name]
    return chosen


def auto_experts(cfg: Config, device: str, world_size: int = 1) -> str:
    """backend.experts=auto: SonicMoE's kernels (``sonic``) where the package is installed and imports, its kernels
    apply to this run (``unsupported_reason``; no FP8 or LoRA on the experts) and the experts' weights stay in the
    memory order ``sonic_layout`` gives them (not FSDP2-wrapped: its gathered weights are laid out as moelab's, and
    each call would copy them); otherwise ``auto`` (GroupedExperts picks torch._grouped_mm, or the loop where that
    cannot run). Measured ahead of torch's grouped GEMM in the whole compiled step of the Qwen3 proxy
    (gallery/perf-notes.md, issue 41)."""
    from moelab.config.lora import lora_targets
    from moelab.layout.dims import fsdp_wraps

    lora, p = cfg.train.lora, cfg.parallel
    if (not _DETECTED["sonic"] or unsupported_reason("sonic", cfg, device, world_size) is not None
            or cfg.train.fp8 != "off" or (lora.rank and "experts" in lora_targets(lora.targets))
            or fsdp_wraps(max(world_size // p.pp, 1), cfg)  # ep = 1 here: the experts' mesh is a stage's ranks
            or cfg.model.hidden_size % 64 or cfg.model.moe.expert_ffn_size % 64):  # whole tiles: shapes measured
        return "auto"
    try:
        import_package("sonic")
    except BackendUnavailable as e:  # installed but broken here: say so once, keep torch's path
        warnings.warn(f"backend.experts=auto keeps torch's grouped GEMM: {e}", RuntimeWarning, stacklevel=3)
        return "auto"
    return "sonic"


FA4_HEAD_DIMS = (64, 128)
"""The head dims backend.attention=fa4 takes (FlashAttention-4's sm90 tiles; 128 measured, issue 41)."""


def auto_attention(cfg: Config, device: str, world_size: int = 1) -> str:
    """backend.attention=auto: FlashAttention-4's kernels (``fa4``) where the package is installed and imports and
    they apply to this run (``unsupported_reason``: GQA / MHA, no context parallelism, a head dim of FA4_HEAD_DIMS,
    bf16 on an sm90 / sm100 GPU; its layers' windows, sinks and packed documents keep sdpa's paths); otherwise
    ``sdpa``. Measured ahead of SDPA (cuDNN's kernels) at the Qwen3 proxy's shapes (gallery/perf-notes.md,
    issue 41)."""
    if not _DETECTED["fa4"] or unsupported_reason("fa4", cfg, device, world_size) is not None:
        return "sdpa"
    try:
        import_package("fa4")
    except BackendUnavailable as e:  # installed but broken here: say so once, keep SDPA
        warnings.warn(f"backend.attention=auto keeps SDPA: {e}", RuntimeWarning, stacklevel=3)
        return "sdpa"
    return "fa4"


def _auto_loss(cfg: Config, device: str, world_size: int) -> str:
    from moelab.planner.plan import resolve_loss

    on_cuda = device.startswith("cuda")
    memory_gb = None
    if on_cuda:
        import torch

        if torch.cuda.is_available():  # else (a check of a GPU config on a CPU machine) the planner's default GPU
            memory_gb = torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30
    return resolve_loss(cfg, world_size, memory_gb, on_cuda=on_cuda)


def apply_backends(model, cfg: Config, device: str = "cpu", world_size: int = 1) -> dict[str, str]:
    """Swap the chosen backends into a model built on the meta device (before it is materialised).
    Returns the effective switchboard; the dispatcher choice is read by moelab.parallel when it builds the
    EP dispatcher (``moelab.parallel.deepep.DeepEPDispatcher``)."""
    chosen = check_backends(cfg, device, world_size)
    if chosen["experts"] == "te" or chosen["attention"] == "te":
        from moelab.backends.te import apply_te

        apply_te(model, cfg, experts=chosen["experts"] == "te", attention=chosen["attention"] == "te")
    if chosen["attention"] == "fa4":
        for block in model.layers.values():  # GQA layers (MLA is refused: unsupported_reason)
            block.attention.backend = "fa4"
    for moe in model.moe_layers():
        if hasattr(moe.experts, "impl"):
            moe.experts.impl = chosen["experts"] if chosen["experts"] != "te" else moe.experts.impl
        if chosen["experts"] == "sonic":  # its weights in SonicMoE's memory order: no copy per call
            from moelab.backends.sonic import sonic_layout

            sonic_layout(moe.experts)
    model.backends = chosen
    model.loss_kind = chosen["loss"]  # the LM head's loss (moelab.backends.loss), after any fallback
    return chosen


def experts_kernel(impl: str, experts=None):
    """The function (x_ND, w_gate_up_EDF2, w_down_EFD, counts_E, scale_N=None) -> y_ND for an experts backend on
    stacked weights (GroupedExperts' hook; scale_N the rows' routing weights, applied before the down projection).
    Such kernels compute plain SwiGLU experts without biases."""
    if impl == "grouped_gemm":
        if experts is not None and (experts.b_gate_up_EF2 is not None or experts.activation != "swiglu"):
            raise BackendUnavailable("backend.experts='grouped_gemm' computes SwiGLU experts without biases; this "
                                     "model has expert biases or another activation: use backend.experts=auto")
        from moelab.backends.gmm import gmm_swiglu

        import_package("grouped_gemm")
        return gmm_swiglu
    raise BackendUnavailable(f"backend.experts={impl!r} has no stacked-weight kernel; choose one of "
                             f"auto, grouped_mm, loop, grouped_gemm, te, triton_fused, sonic")
