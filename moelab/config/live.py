"""The fields a run lets you change while it trains (Run.set, `moelab set`, the dashboard's controls, Run.fork),
and the one check every change goes through before anything is written.

A change is checked exactly as a config is (Config.replace: the same coercion and the same rules, so a bad value
gets the same message), then refused unless its field is in LIVE_FIELDS. Everything else is fixed for a run's
life, with the reason: shapes and layout (the weights and their placement), the data and batch (the step is the
data position), the optimizer's settings (its state depends on them) and the schedule's length.

    cfg2, changes = check_changes(cfg, {"model.moe.aux_loss_coeff": "1e-2"})   # {"...aux_loss_coeff": 0.01}
    check_changes(cfg, {"model.moe.num_experts": 16})                          # ConfigError: ... cannot change
"""
from __future__ import annotations

from typing import Any

from moelab.config.rules import ConfigError
from moelab.contract.controls import CHECKPOINT_NOW  # the action "checkpoint at the next step boundary"

# field -> what changing it does from the next step on
LIVE_FIELDS = {
    "train.lr": "the peak learning rate; warm-up and cosine decay follow it from the next step",
    "train.grad_clip": "the gradient-norm clip (0 = none)",
    "train.eval_every": "held-out evaluation every N steps (0 = never)",
    "train.expert_tokens_every": "expert token records every N steps (0 = never)",
    "train.checkpoint_every": "a checkpoint every N steps (0 = only at the end)",
    "model.moe.aux_loss_coeff": "the load-balancing loss weight",
    "model.moe.z_loss_coeff": "the router z-loss weight",
    "model.moe.bias_update_rate": "the aux-loss-free bias step (0 freezes the expert bias where it is)",
    "model.moe.capacity_factor": "token dropping's capacity factor (the factor in force restarts from it)",
    "model.moe.dynamic_capacity": "dynamic capacity on or off",
    "model.moe.freeze_router": "router weights frozen (no update) or training",
    "model.moe.expert_lr_power": "per-expert learning-rate scaling by utilisation (0 = off)",
    "model.moe.expert_lr_max_scale": "the cap of the per-expert learning-rate scale",
}

# the first matching prefix says why a field is fixed while a run trains
FIXED_REASONS = (
    ("train.steps", "the learning-rate schedule spans train.steps; stop the run and resume(steps=M) instead"),
    ("train.lora", "the trained parameters and the optimizer state depend on it"),
    ("train.beta", "AdamW's moments depend on it"),
    ("train.weight_decay", "the optimizer's parameter groups are built with it"),
    ("train.", "the data, the batch or the numerics are fixed for a run's life (the step is the data position)"),
    ("model.moe.", "it changes the routing function or the experts' shapes, which the weights are trained for"),
    ("model.", "it changes the model's shapes or vocabulary, which the weights and optimizer state are made of"),
    ("parallel.", "the layout is fixed while ranks run; stop the run and resume it on another layout"),
    ("backend.", "the kernels are chosen at setup; stop the run and resume it with another backend"),
    ("data.", "the data is fixed for a run's life (the step is the data position)"),
    ("name", "a run's name is its folder"),
)


def get_dotted(cfg, key: str) -> Any:
    """The value of dotted field `key` ("model.moe.aux_loss_coeff") of `cfg`."""
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def set_dotted(cfg, key: str, value: Any) -> None:
    """Set dotted field `key` of `cfg` to `value` (no check: check_changes checks)."""
    *parents, last = key.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    setattr(node, last, value)


def fixed_reason(key: str) -> str:
    """Why field `key` cannot change while a run trains (the first FIXED_REASONS prefix it matches)."""
    return next(why for prefix, why in FIXED_REASONS if key.startswith(prefix) or key == prefix)


def check_changes(cfg, changes: dict) -> tuple[Any, dict]:
    """(the config with `changes` applied, the changes with their values coerced as the config reads them);
    ConfigError naming the field, the value and the fix for an unknown field, a bad value or a field that
    cannot change while a run trains. `cfg` is not modified."""
    if not isinstance(changes, dict) or not changes:
        raise ConfigError(f"changes={changes!r}: give at least one field=value, e.g. model.moe.aux_loss_coeff=0.01; "
                          f"the fields a run can change: {', '.join(LIVE_FIELDS)}, or checkpoint=True")
    out = {}
    if CHECKPOINT_NOW in changes:
        value = changes[CHECKPOINT_NOW]
        if value not in (True, "true", "True", 1, "1", "now"):
            raise ConfigError(f"checkpoint={value!r}: give checkpoint=True to save a checkpoint at the next step "
                              f"boundary")
        out[CHECKPOINT_NOW] = True
    fields = {k: v for k, v in changes.items() if k != CHECKPOINT_NOW}
    new = cfg.replace(**fields) if fields else cfg  # unknown keys and bad values: the config's own messages
    for key in fields:
        if key not in LIVE_FIELDS:
            raise ConfigError(f"{key}={fields[key]!r}: cannot change while a run trains ({fixed_reason(key)}); "
                              f"the fields a run can change: {', '.join(LIVE_FIELDS)}")
        out[key] = get_dotted(new, key)
    return new, out
