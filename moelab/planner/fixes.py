"""What to change when a plan does not fit: settings aimed at the biggest memory term first, each planned, the
first one (or pair) that fits returned with its plan, so that the verdict can say a concrete `--set` that fits.

    change, fitted = fitting_change(load_config("deepseek-v3"), "optimizer",
                                    lambda c: plan(c, gpus=256, gpu_memory_gb=80, suggest=False))
    change                               # {'train.optimizer_state': 'bf16_moments'}
    fitted.memory_per_gpu_bytes          # under 95% of 80 GiB

Every candidate is one setting a user would type; the layout validator (moelab.layout.dims) refuses those the
world cannot run, and the search skips them. The global batch and the world stay as asked.
"""
from __future__ import annotations

import itertools

from moelab.config import Config, ConfigError


def _candidates(cfg: Config) -> dict[str, dict]:
    """One-setting changes by name (None where the setting is already there)."""
    p, t = cfg.parallel, cfg.train
    # a layout that names its fsdp keeps the world: doubling pp or tp halves it
    half = {"parallel.fsdp": p.fsdp // 2} if p.fsdp > 1 and p.fsdp % 2 == 0 else {}
    out = {
        "bf16_moments": {"train.optimizer_state": "bf16_moments"} if t.optimizer_state != "bf16_moments" else None,
        "full": {"train.activation_checkpointing": "full"} if t.activation_checkpointing != "full" else None,
        "micro_batch": {"train.micro_batch_size": t.micro_batch_size // 2} if t.micro_batch_size > 1 else None,
        "ep": {"parallel.ep": 2 * p.ep},
        "pp": {"parallel.pp": 2 * p.pp, "parallel.pp_schedule": p.pp_schedule if p.pp > 1 else "1f1b",
               **({"parallel.fsdp_grad_sync": "auto"} if p.fsdp_grad_sync == "micro_batch" else {}), **half},
        "tp": {"parallel.tp": 2 * p.tp, **half},
        "grad_sync": {"parallel.fsdp_grad_sync": "micro_batch"} if p.pp == 1 and p.fsdp_grad_sync != "micro_batch"
        else None,
        "chunked": {"backend.loss": "chunked"} if cfg.backend.loss in ("full", "auto") else None,
        "fp8_off": {"train.fp8": "off"} if t.fp8 != "off" else None,
    }
    return {k: v for k, v in out.items() if v}


# the changes that shrink each memory term, most direct first (moelab.planner.plan.MEMORY_TERMS)
_BY_TERM = {
    "parameters": ("pp", "ep", "tp", "bf16_moments"),
    "gradients": ("pp", "ep", "tp", "bf16_moments"),
    "optimizer": ("bf16_moments", "pp", "ep", "tp"),
    "gathered_params": ("ep", "tp", "pp"),
    "held_unsharded": ("grad_sync", "ep", "tp", "pp"),
    "fp8_weights": ("fp8_off", "ep", "pp"),
    "activations": ("full", "micro_batch", "tp"),
    "logits": ("chunked", "micro_batch", "tp"),
    "dispatcher": ("micro_batch", "tp"),
}
_ANY = ("bf16_moments", "full", "ep", "pp", "tp", "micro_batch", "chunked", "grad_sync", "fp8_off")


def fitting_change(cfg: Config, biggest: str, planner):
    """(settings, their plan) of the first change to `cfg` that fits: one setting, those that shrink `biggest`
    first, then two together; None when nothing tried fits. `planner(cfg)`: the plan of a changed config on the
    same GPUs (moelab.planner.plan.plan with suggest=False)."""
    found = _candidates(cfg)
    order = [k for k in _BY_TERM.get(biggest, ()) if k in found] + [k for k in _ANY if k in found]
    order = list(dict.fromkeys(order))
    tries = [found[k] for k in order] + [{**found[a], **found[b]} for a, b in itertools.combinations(order[:6], 2)]
    for change in tries:
        try:
            fitted = planner(cfg.replace(**change))
        except ConfigError:  # a layout the world cannot run, or a setting this config refuses
            continue
        if fitted.fits:
            return change, fitted
    return None


def set_text(change: dict) -> str:
    """`change` as the command line's flags."""
    return " ".join(f"--set {k}={v}" for k, v in change.items())
