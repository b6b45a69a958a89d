"""moelab's one config dialect: typed dataclasses, YAML in and out, dotted overrides.

    cfg = load_config("tiny", overrides=["model.moe.num_experts=16", "train.steps=20"])
    cfg.model.moe.top_k            # 2
    save_config(cfg, "run/config.yaml"); load_config("run/config.yaml") == cfg   # True

Every value is checked when a Config is built (``Config.validate``), and every error names the field, the
value and the fix (`ConfigError`). Layout checks that need the world size live in moelab.parallel.dims (``ParallelDims``).
Nothing here touches torch or hardware: a config can be built and planned on any machine.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from moelab.yaml_loader import DuplicateKey, UniqueKeyLoader


class ConfigError(ValueError):
    """An invalid config value. The message names the field, the value and the fix.

        Session("tiny", train={"steps": 0})   # ConfigError: train.steps=0: must be >= 1
    """

    def _render_traceback_(self) -> list:
        """How IPython and Jupyter show it: the message and where it was raised, the traceback folded away."""
        tb, where = self.__traceback__, ""
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            where = f"raised in {tb.tb_frame.f_code.co_name} ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}); "
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}",
                f"\x1b[2m({where}the whole traceback: import sys, traceback; "
                "traceback.print_exception(sys.last_value))\x1b[0m"]


def _fail(field_name: str, value: Any, fix: str) -> typing.NoReturn:
    raise ConfigError(f"{field_name}={value!r}: {fix}")


@dataclass
class MoEConfig:
    """The MoE layer: experts, routing, balancing (aux loss, z-loss, aux-loss-free bias), capacity.

        MoEConfig(num_experts=16, top_k=2, aux_loss_coeff=1e-3)   # or load_config("tiny", ["model.moe.top_k=1"])
    """
    num_experts: int = 8
    top_k: int = 2
    expert_ffn_size: int = 128
    num_shared_experts: int = 0
    # softmax/sigmoid: score all experts, pick the top-k; softmax_topk (GPT-OSS): pick the top-k logits, then
    # softmax over those k only.
    score_func: Literal["softmax", "sigmoid", "softmax_topk"] = "softmax"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    # Group-limited (two-level) routing: experts split into num_groups groups, tokens pick topk_groups first.
    num_groups: int = 1
    topk_groups: int = 1
    # Load balancing. aux_loss_type: "batch" = Switch-style over the micro batch; "sequence" = DeepSeek-V3's
    # per-sequence loss, averaged over sequences.
    aux_loss_coeff: float = 0.0
    aux_loss_type: Literal["batch", "sequence"] = "batch"
    z_loss_coeff: float = 0.0
    # Aux-loss-free balancing: bias += rate * sign(mean_load - load), after the optimizer step. 0 = off.
    bias_update_rate: float = 0.0
    # Routing-lab knob, a skewed router: the selection bias starts at init_bias_skew * linspace(1, -1, E)
    # (low-numbered experts favoured) instead of 0. bias_update_rate moves it; other strategies balance against it.
    init_bias_skew: float = 0.0
    # Token dropping: capacity = ceil(capacity_factor * tokens * top_k / num_experts). 0 = no dropping.
    capacity_factor: float = 0.0
    # Dynamic capacity: factor = 1 + 0.5 * sigmoid(std(load) - 1) over the last capacity_window steps.
    dynamic_capacity: bool = False
    capacity_window: int = 10
    # Per-expert learning-rate scaling by utilisation: lr_e = lr * clip((1/E / share_e) ** power, 1, max).
    expert_lr_power: float = 0.0
    expert_lr_max_scale: float = 4.0
    # Expert health: an expert with no tokens for this many steps is reported dead.
    dead_expert_steps: int = 5
    overload_factor: float = 2.0
    # GPT-OSS: a learned router bias, biases on the expert projections, and its clamped SwiGLU
    # ((up + 1) * gate * sigmoid(1.702 * gate), gate <= 7, |up| <= 7).
    router_bias: bool = False
    expert_proj_bias: bool = False
    activation: Literal["swiglu", "gpt_oss"] = "swiglu"


@dataclass
class RopeScalingConfig:
    """YaRN rotary scaling as in the published DeepSeek-V3, Kimi-K2 and GPT-OSS checkpoints (HF's "yarn").
    It changes the rotary frequencies at every length, so loaded checkpoints need it for matching logits.

        load_config("gpt-oss-20b").model.rope_scaling
    """
    kind: Literal["none", "yarn"] = "none"
    factor: float = 1.0
    original_max_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # DeepSeek-style softmax-scale correction: scale *= (0.1 * mscale_all_dim * ln(factor) + 1) ** 2 (MLA only);
    # cos/sin are multiplied by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim). 0 = unset.
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclass
class ModelConfig:
    """The decoder: sizes, attention kind (GQA or MLA, sliding windows, sinks), dense and MoE layers.

        load_config("tiny").model.num_layers          # 4
        ModelConfig(hidden_size=128, moe=MoEConfig(num_experts=16))
    """
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_dense_layers: int = 1
    dense_ffn_size: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qk_norm: bool = False
    # Attention kind: gqa (MHA when num_kv_heads == num_heads) or mla (DeepSeek-V3 / Kimi-K2).
    attention: Literal["gqa", "mla"] = "gqa"
    # MLA shapes (used when attention == "mla"); q_lora_rank 0 = full-rank q projection.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Sliding-window attention (GPT-OSS): window in tokens; 0 = full attention everywhere.
    # sliding_pattern "alternate" makes even layers sliding and odd layers full.
    sliding_window: int = 0
    sliding_pattern: Literal["all", "alternate"] = "alternate"
    attention_sinks: bool = False
    attention_bias: bool = False
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    # The gate's activation in the dense FFN, shared experts and swiglu experts, act(gate) * up, by transformers'
    # hidden_act names (moelab.model.layers.HIDDEN_ACTS; GPT-OSS experts keep their own clamped activation).
    hidden_act: Literal["silu", "swish", "gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh",
                        "gelu_fast", "gelu_accurate", "gelu_10", "quick_gelu", "relu", "relu2", "relu6", "leaky_relu",
                        "sigmoid", "tanh", "mish", "hardswish", "laplace", "linear"] = "silu"
    # Padding token id (-1 = none): its embedding row gets no gradient (nn.Embedding padding_idx), and targets
    # equal to it (or to -100) are left out of the loss and of the routing statistics and aux losses.
    pad_token_id: int = -1


@dataclass
class ParallelConfig:
    """Layout [TP, PP, CP, EP, VP, FSDP]: world = tp * pp * cp * fsdp; ep divides fsdp * cp * tp (checked
    against a world size by moelab.parallel.dims.ParallelDims).

        load_config("tiny", {"parallel.ep": 2, "parallel.fsdp": -1}).parallel
    """
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vp: int = 1
    # Data-parallel (FSDP2) degree; -1 = whatever the world size leaves after tp, pp and cp.
    fsdp: int = -1
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"


@dataclass
class TrainConfig:
    """The step loop: steps, batch sizes, sequence length, optimizer, dtypes, checkpoints, failure policy.

        load_config("tiny", {"train.steps": 20, "train.micro_batch_size": 2}).train
    """
    steps: int = 50
    global_batch_size: int = 8
    micro_batch_size: int = 4
    seq_len: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = no clipping
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Parameter (and gradient, optimizer state) dtype. float32 = fp32 master weights, bf16 compute by autocast or
    # FSDP2 mixed precision; bfloat16 = parameters stored in bf16 (as HF/torchtitan benchmarks run): half the
    # memory traffic of the optimizer step, no per-step weight casts; needs train.dtype=bfloat16.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False
    # FP8 training: off, or rowwise = dynamically scaled e4m3 GEMMs (one scale per row) for the routed experts
    # and the attention / dense projections; router, norms, embedding, LM head stay bf16 (moelab.model.fp8);
    # rowwise_lm_head = the same plus the LM head (the largest GEMM; opt-in until its loss parity is shown).
    fp8: Literal["off", "rowwise", "rowwise_lm_head"] = "off"
    checkpoint_every: int = 0  # 0 = only on SIGTERM/SIGUSR1 and at the end
    keep_checkpoints: int = 2
    # False = never write a checkpoint (benchmarks of big models: a checkpoint is ~12 bytes per parameter);
    # a stop signal then just ends the run (PREEMPTED) at the step boundary. See moelab.train.checkpoint.
    save_checkpoints: bool = True
    on_nan: Literal["stop", "skip"] = "stop"
    collective_timeout_s: float = 120.0


@dataclass
class BackendConfig:
    """The kernel switchboard. Availability of optional packages is checked by moelab.backends at run time.

        load_config("tiny", ["backend.attention=eager", "backend.fallback=true"]).backend
    """
    attention: Literal["sdpa", "flex", "eager", "te"] = "sdpa"
    experts: Literal["auto", "grouped_mm", "loop", "grouped_gemm", "te"] = "auto"
    dispatcher: Literal["all_to_all", "deepep"] = "all_to_all"
    fake_balanced_gate: bool = False
    fake_gate_noise: float = 0.0
    fallback: bool = False  # True = an unavailable backend falls back to the torch path with a warning
    # TE's FP8 recipes for the attention projections of backend.attention=te: current (per-tensor current
    # scaling) or block (1x128 / 128x128 block scaling). moelab's own FP8 path is train.fp8.
    te_fp8: Literal["off", "current", "block"] = "off"


@dataclass
class DataConfig:
    """Where the tokens come from: a synthetic Markov chain, uniform random tokens, or a token file.

        load_config("tiny", ["data.kind=random"]).data
    """
    # synthetic: a learnable Markov chain; random: uniform tokens (benchmarks); tokens: a token file
    kind: Literal["synthetic", "random", "tokens"] = "synthetic"
    path: str = ""  # a flat file of token ids for kind == "tokens"
    token_dtype: Literal["uint16", "uint32", "int32"] = "uint16"
    # synthetic: a fixed random Markov chain; each token follows its successor with prob 1 - noise.
    noise: float = 0.1


@dataclass
class Config:
    """A whole run: model, layout, training, backends and data, validated when built (Config.validate).

        cfg = load_config("tiny", ["parallel.ep=2"])
        cfg.replace(**{"train.steps": 10})          # a new, validated Config
    """
    name: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ conversions
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return _build(cls, d, "")

    def replace(self, **dotted: Any) -> "Config":
        """A copy with dotted keys replaced: ``cfg.replace(**{"train.steps": 5})``."""
        d = self.to_dict()
        for key, value in dotted.items():
            _set_dotted(d, key, value)
        return Config.from_dict(d)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        m, moe, p, t, b = self.model, self.model.moe, self.parallel, self.train, self.backend
        _positive = [("model.vocab_size", m.vocab_size), ("model.hidden_size", m.hidden_size),
                     ("model.num_layers", m.num_layers), ("model.num_heads", m.num_heads),
                     ("model.num_kv_heads", m.num_kv_heads), ("model.head_dim", m.head_dim),
                     ("model.moe.top_k", moe.top_k), ("model.moe.num_experts", moe.num_experts),
                     ("model.moe.expert_ffn_size", moe.expert_ffn_size), ("model.moe.num_groups", moe.num_groups),
                     ("train.steps", t.steps),
                     ("train.global_batch_size", t.global_batch_size),
                     ("train.micro_batch_size", t.micro_batch_size), ("train.seq_len", t.seq_len),
                     ("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.cp", p.cp),
                     ("parallel.ep", p.ep), ("parallel.vp", p.vp)]
        at_least_one = {name for name, _ in _positive}  # one rule for these: -5 and 0 both say ">= 1"
        for section, obj in _sections(self):
            for f in fields(obj):
                v = getattr(obj, f.name)
                if f.type in ("int", int) and f.name not in ("fsdp", "seed", "pad_token_id") and v < 0 \
                        and f"{section}.{f.name}" not in at_least_one:
                    _fail(f"{section}.{f.name}", v, "must be >= 0")
        for name, v in _positive:
            if v < 1:
                _fail(name, v, "must be >= 1")
        if moe.top_k > moe.num_experts:
            _fail("model.moe.top_k", moe.top_k,
                  f"cannot exceed model.moe.num_experts={moe.num_experts}; lower top_k or add experts")
        if m.num_heads % m.num_kv_heads:
            _fail("model.num_kv_heads", m.num_kv_heads,
                  f"must divide model.num_heads={m.num_heads} (grouped-query attention shares each kv head "
                  f"by num_heads/num_kv_heads query heads)")
        if not -1 <= m.pad_token_id < m.vocab_size:
            _fail("model.pad_token_id", m.pad_token_id, f"must be -1 (no padding) or a token id below "
                  f"model.vocab_size={m.vocab_size}")
        if m.num_dense_layers > m.num_layers:
            _fail("model.num_dense_layers", m.num_dense_layers, f"cannot exceed model.num_layers={m.num_layers}")
        if m.num_dense_layers > 0 and m.dense_ffn_size < 1:
            _fail("model.dense_ffn_size", m.dense_ffn_size, "must be >= 1 when model.num_dense_layers > 0")
        if m.attention == "gqa" and m.head_dim % 2:
            _fail("model.head_dim", m.head_dim, "must be even (rotary embeddings rotate pairs)")
        if m.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(m, name) < 1:
                    _fail(f"model.{name}", getattr(m, name), "must be >= 1 when model.attention='mla'")
            if m.qk_rope_head_dim % 2:
                _fail("model.qk_rope_head_dim", m.qk_rope_head_dim, "must be even")
        if m.attention_sinks and b.attention not in ("eager", "flex", "te"):
            _fail("backend.attention", b.attention,
                  "attention sinks need backend.attention='eager', 'flex' or 'te' (SDPA has no sink logits)")
        if b.te_fp8 != "off" and (b.attention != "te" or m.attention == "mla"):
            _fail("backend.te_fp8", b.te_fp8, "TE's FP8 recipes run the TE Linear projections of "
                  "backend.attention='te' on GQA/MHA models; set backend.attention=te, or backend.te_fp8=off")
        if moe.num_experts % moe.num_groups:
            _fail("model.moe.num_groups", moe.num_groups, f"must divide model.moe.num_experts={moe.num_experts}")
        if not 1 <= moe.topk_groups <= moe.num_groups:
            _fail("model.moe.topk_groups", moe.topk_groups,
                  f"must be between 1 and model.moe.num_groups={moe.num_groups}")
        if moe.num_groups > 1 and moe.top_k > moe.topk_groups * (moe.num_experts // moe.num_groups):
            _fail("model.moe.top_k", moe.top_k,
                  "exceeds the experts in the topk_groups selected groups; raise model.moe.topk_groups")
        if moe.capacity_factor < 0:
            _fail("model.moe.capacity_factor", moe.capacity_factor, "must be >= 0 (0 = no token dropping)")
        if moe.dynamic_capacity and moe.capacity_factor == 0:
            _fail("model.moe.dynamic_capacity", True, "needs model.moe.capacity_factor > 0 as its starting factor")
        for name in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate", "init_bias_skew", "expert_lr_power"):
            if getattr(moe, name) < 0:
                _fail(f"model.moe.{name}", getattr(moe, name), "must be >= 0")
        for name, fix in (("overload_factor", "must be >= 1 (times the mean load)"),
                          ("dead_expert_steps", "must be >= 1 (steps without tokens)")):
            if getattr(moe, name) < 1:
                _fail(f"model.moe.{name}", getattr(moe, name), fix)
        if moe.route_scale <= 0:
            _fail("model.moe.route_scale", moe.route_scale, "must be > 0")
        if moe.score_func == "softmax_topk" and moe.num_groups > 1:
            _fail("model.moe.num_groups", moe.num_groups,
                  "group-limited routing needs model.moe.score_func 'softmax' or 'sigmoid'; set num_groups=1")
        rs = m.rope_scaling
        if rs.kind == "yarn":
            if rs.factor < 1:
                _fail("model.rope_scaling.factor", rs.factor, "must be >= 1 for yarn")
            if rs.original_max_len < 1 or rs.beta_fast <= 0 or rs.beta_slow <= 0:
                _fail("model.rope_scaling", f"original_max_len={rs.original_max_len} beta_fast={rs.beta_fast} "
                      f"beta_slow={rs.beta_slow}", "yarn needs original_max_len >= 1 and betas > 0")
        if t.global_batch_size % t.micro_batch_size:
            _fail("train.global_batch_size", t.global_batch_size,
                  f"must be a multiple of train.micro_batch_size={t.micro_batch_size}")
        if t.lr <= 0:
            _fail("train.lr", t.lr, "must be > 0")
        for name, v, ok, fix in (("model.rope_theta", m.rope_theta, m.rope_theta > 0, "must be > 0"),
                                 ("model.norm_eps", m.norm_eps, m.norm_eps > 0, "must be > 0"),
                                 ("train.beta1", t.beta1, 0 <= t.beta1 < 1, "must be within [0, 1)"),
                                 ("train.beta2", t.beta2, 0 <= t.beta2 < 1, "must be within [0, 1)"),
                                 ("train.weight_decay", t.weight_decay, t.weight_decay >= 0, "must be >= 0"),
                                 ("train.collective_timeout_s", t.collective_timeout_s,
                                  t.collective_timeout_s > 0, "must be > 0 seconds"),
                                 ("model.moe.expert_lr_max_scale", moe.expert_lr_max_scale,
                                  moe.expert_lr_max_scale >= 1, "must be >= 1"),):
            if not ok:
                _fail(name, v, fix)
        if not 0 <= t.min_lr_ratio <= 1:
            _fail("train.min_lr_ratio", t.min_lr_ratio, "must be within [0, 1]")
        if t.grad_clip < 0:
            _fail("train.grad_clip", t.grad_clip, "must be >= 0 (0 = no clipping)")
        if t.param_dtype == "bfloat16" and t.dtype != "bfloat16":
            _fail("train.param_dtype", t.param_dtype, "bf16 parameters need train.dtype=bfloat16")
        if t.fp8 != "off" and t.dtype != "bfloat16":
            _fail("train.fp8", t.fp8, "FP8 training computes in bf16 around its FP8 GEMMs: set train.dtype=bfloat16")
        if t.fp8 != "off" and b.experts not in ("auto", "grouped_mm"):
            _fail("train.fp8", t.fp8, f"FP8 experts run their own grouped GEMMs, not backend.experts={b.experts!r}; "
                  "set backend.experts=auto (or train.fp8=off)")
        if t.fp8 != "off" and t.device == "cpu":
            _fail("train.fp8", t.fp8, "FP8 GEMMs need a CUDA GPU of compute capability 9.0+ (Hopper); set "
                  "train.fp8=off on CPU")
        if t.keep_checkpoints < 1:
            _fail("train.keep_checkpoints", t.keep_checkpoints, "must be >= 1")
        if p.fsdp == 0 or p.fsdp < -1:
            _fail("parallel.fsdp", p.fsdp, "must be >= 1, or -1 to fill the world size")
        if moe.num_experts % p.ep:
            _fail("parallel.ep", p.ep, f"must divide model.moe.num_experts={moe.num_experts} "
                  f"(each EP rank owns num_experts/ep experts); try ep in {_divisors(moe.num_experts)}")
        if p.vp > 1 and p.pp == 1:
            _fail("parallel.vp", p.vp, "virtual stages need parallel.pp > 1; set parallel.vp=1")
        if p.pp_schedule == "interleaved_1f1b" and p.vp == 1 and p.pp > 1:
            _fail("parallel.pp_schedule", p.pp_schedule, "needs parallel.vp > 1; use '1f1b' or set parallel.vp")
        if p.tp > 1:
            _fail("parallel.tp", p.tp, "tensor parallel is not supported yet; use parallel.ep and parallel.fsdp "
                  "(supported: ep, fsdp, pp with vp)")
        if b.fake_gate_noise < 0:
            _fail("backend.fake_gate_noise", b.fake_gate_noise, "must be >= 0")
        if self.data.kind == "tokens" and not self.data.path:
            _fail("data.path", self.data.path, "data.kind='tokens' needs data.path to a token file")
        if not 0 <= self.data.noise <= 1:
            _fail("data.noise", self.data.noise, "must be within [0, 1]")


def _sections(obj, prefix: str = ""):
    """(dotted name, dataclass) for every section of a config, nested ones included."""
    yield prefix.rstrip("."), obj
    for f in fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from _sections(v, f"{prefix}{f.name}.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------------- building from dicts (YAML, CLI)
def _build(cls, d: Any, prefix: str):
    if not isinstance(d, dict):
        _fail(prefix.rstrip(".") or "config", d, f"expected a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in d.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(sorted(known))}"
            _fail(f"{prefix}{key}", value, f"unknown key; {hint}")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(tp, value, name):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, name + ".")
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            _fail(name, value, f"choose one of {list(choices)}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        _fail(name, value, "expected true or false")
    if tp is int:
        if isinstance(value, bool):
            _fail(name, value, "expected an integer, got a boolean")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except ValueError:
                pass
        _fail(name, value, "expected an integer")
    if tp is float:
        if isinstance(value, bool):
            _fail(name, value, "expected a number, got a boolean")
        if isinstance(value, (int, float, str)):
            try:
                number = float(value)
            except (ValueError, OverflowError):
                _fail(name, value, "expected a number")
            if not math.isfinite(number):
                _fail(name, value, "expected a finite number")
            return number
        _fail(name, value, "expected a number")
    if tp is str:
        if not isinstance(value, str):
            _fail(name, value, "expected a string")
        return value
    raise TypeError(f"moelab.config: no coercion for {tp} ({name})")


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = d
    for i, part in enumerate(parts[:-1]):
        if part not in node or not isinstance(node[part], dict):
            prefix = ".".join(parts[:i])
            options = [k for k, v in node.items() if isinstance(v, dict)]
            close = difflib.get_close_matches(part, options, n=1)
            hint = f"did you mean '{'.'.join(parts[:i] + [close[0]])}'?" if close else f"sections: {options}"
            _fail(key, value, f"'{part}' is not a section{' of ' + prefix if prefix else ''}; {hint}")
        node = node[part]
    node[parts[-1]] = value


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested sections to dotted keys: {"train": {"steps": 20}, "name": "x"} -> {"train.steps": 20, "name": "x"}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """'model.moe.num_experts=16' -> ('model.moe.num_experts', 16); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, for example model.moe.num_experts=16")
    key, raw = text.split("=", 1)
    try:
        value = _yaml_load(raw, f"--set {key.strip()}", file=False) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


# ---------------------------------------------------------------------- loading and saving
def _yaml_load(text: str, where: str, file: bool = True):
    """YAML text -> Python, refusing duplicated keys with a ConfigError naming the key (and its lines in a
    `file`)."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except DuplicateKey as e:
        lines = f"{where}:{e.line}: key {e.key!r} is given twice (first on line {e.first})" if file else \
            f"{where}: key {e.key!r} is given twice"
        raise ConfigError(f"{lines}; keep one of them (YAML would silently use the last)") from None


def load_config(source: "str | Path | Config | dict", overrides: "list[str] | dict | None" = None) -> Config:
    """A Config from a preset name, a YAML path, a dict or a Config, with dotted overrides applied.

        load_config("tiny", ["train.steps=20"])
        load_config("my.yaml", {"parallel.ep": 2})
    """
    if isinstance(source, Config):
        d = source.to_dict()
    elif isinstance(source, dict):
        d = Config.from_dict(source).to_dict()
    else:
        d = _read_source(str(source))
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or [])
    for key, value in items:
        _set_dotted(d, key, value)
    return Config.from_dict(d)


def _read_source(source: str, _seen: tuple = ()) -> dict:
    from moelab.presets import preset_names, preset_path

    path = Path(source)
    if source in preset_names():
        path = preset_path(source)
    elif not path.exists():
        if path.suffix in (".yaml", ".yml") or "/" in source:
            raise ConfigError(f"config file {source!r} does not exist; give a YAML path or one of the presets: "
                              f"{', '.join(preset_names())}")
        close = difflib.get_close_matches(source, preset_names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown preset {source!r}.{hint} Presets: {', '.join(preset_names())} "
                          f"(or give a path to a YAML file)")
    try:
        data = _yaml_load(path.read_text(), str(path))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    base = data.pop("base", None)  # a YAML file may start from a preset: `base: qwen3-moe-30b-a3b`
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: base={base!r}: expected a preset name or a YAML path")
    if path.resolve() in _seen:
        raise ConfigError(f"{path}: its `base:` chain loops back to this file; break the loop")
    d = _read_source(base, _seen + (path.resolve(),)) if base else Config().to_dict()
    d["name"] = data.get("name", d.get("name"))
    _merge(d, data, "")
    return d


def _merge(dst: dict, src: dict, prefix: str) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v, f"{prefix}{k}.")
        else:
            if k not in dst:
                Config.from_dict(_nest(f"{prefix}{k}", v))  # raises with a did-you-mean for unknown keys
            dst[k] = v


def _nest(dotted: str, value: Any) -> dict:
    d: dict = {}
    _set_nested = d
    parts = dotted.split(".")
    for p in parts[:-1]:
        _set_nested = _set_nested.setdefault(p, {})
    _set_nested[parts[-1]] = value
    return d


def save_config(cfg: Config, path: "str | Path") -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
