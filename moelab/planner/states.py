"""What the training state of one trained parameter holds, by train.param_dtype and train.optimizer_state:
the stored weight, its gradient and AdamW's two moments (exp_avg, exp_avg_sq), in bytes. Torch-free: the
planner counts it and moelab.train.optim allocates it from the same answer.

    state_bytes(load_config("tiny", ["train.optimizer_state=bf16_moments"]).train)
    # StateBytes(weight=4, gradient=4, moments=4): fp32 master and gradient, m and v in bf16
"""
from __future__ import annotations

from typing import NamedTuple

from moelab.config import TrainConfig

# train.optimizer_state -> (weight / gradient dtype, moment dtype); "auto": the moments in the weights' dtype
STATE_DTYPES = {"fp32": ("float32", "float32"), "bf16_moments": ("float32", "bfloat16"),
                "bf16": ("bfloat16", "bfloat16")}
_BYTES = {"float32": 4, "bfloat16": 2}


class StateBytes(NamedTuple):
    """Bytes of one trained parameter's stored weight, gradient and AdamW moments (m and v together).

        state_bytes(load_config("tiny").train)   # StateBytes(weight=4, gradient=4, moments=8)
    """
    weight: int  # the stored (master) weight
    gradient: int
    moments: int  # exp_avg + exp_avg_sq together


def optimizer_state(t: TrainConfig) -> str:
    """train.optimizer_state resolved: "auto" follows train.param_dtype (fp32 weights: "fp32"; bf16: "bf16")."""
    if t.optimizer_state != "auto":
        return t.optimizer_state
    return "bf16" if t.param_dtype == "bfloat16" else "fp32"


def moment_dtype(t: TrainConfig) -> str:
    """The dtype AdamW's exp_avg and exp_avg_sq are stored in: "float32" or "bfloat16"."""
    return STATE_DTYPES[optimizer_state(t)][1]


def state_bytes(t: TrainConfig) -> StateBytes:
    weight, moments = STATE_DTYPES[optimizer_state(t)]
    return StateBytes(_BYTES[weight], _BYTES[weight], 2 * _BYTES[moments])


def describe(t: TrainConfig) -> str:
    """One line for the plan's assumptions."""
    s, b = optimizer_state(t), state_bytes(t)
    weights = "fp32 master weights" if b.weight == 4 else "bf16 weights (no fp32 master)"
    grads = "fp32 gradients" if b.gradient == 4 else "bf16 gradients"
    moments = "fp32" if b.moments == 8 else "bf16"
    return (f"per parameter (train.optimizer_state={s}): {weights} {b.weight} B + {grads} {b.gradient} B + "
            f"AdamW m and v in {moments} {b.moments} B")
