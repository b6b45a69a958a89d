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


class ConfigError(ValueError):
    """An invalid config value. The message names the field, the value and the fix.

        load_config("tiny", ["model.moe.top_k=99"])   # ConfigError: model.moe.top_k=99: cannot exceed ...
    """


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
        """Raise ConfigError naming the field, the value and the fix: first every value on its own (integers
        are never negative, then the rule table _RANGES), then the rules that tie fields together (_TIES)."""
        for section, obj in _sections(self):
            for f in fields(obj):
                v = getattr(obj, f.name)
                if f.type in ("int", int) and f.name not in ("fsdp", "seed") and v < 0:
                    _fail(f"{section}.{f.name}", v, "must be >= 0")
        for name, ok, fix in _RANGES:
            v = _value(self, name)
            if not ok(v):
                _fail(name, v, fix)
        for check in _TIES:
            check(self)
def _value(cfg: "Config", dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


_AT_LEAST_1 = (lambda v: v >= 1, "must be >= 1")
_NOT_NEGATIVE = (lambda v: v >= 0, "must be >= 0")
_POSITIVE = (lambda v: v > 0, "must be > 0")
# One value on its own: (dotted field, accepted, the fix). Rules that tie fields together are in _TIES.
_RANGES = [
    *((name, *_AT_LEAST_1) for name in (
        "model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads", "model.num_kv_heads",
        "model.head_dim", "model.moe.top_k", "model.moe.num_experts", "model.moe.expert_ffn_size",
        "model.moe.num_groups", "train.steps", "train.global_batch_size", "train.micro_batch_size",
        "train.seq_len", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "parallel.vp",
        "train.keep_checkpoints")),
    ("model.moe.capacity_factor", lambda v: v >= 0, "must be >= 0 (0 = no token dropping)"),
    *((f"model.moe.{name}", *_NOT_NEGATIVE) for name in (
        "aux_loss_coeff", "z_loss_coeff", "bias_update_rate", "init_bias_skew", "expert_lr_power")),
    ("model.moe.overload_factor", lambda v: v >= 1, "must be >= 1 (times the mean load)"),
    ("model.moe.dead_expert_steps", lambda v: v >= 1, "must be >= 1 (steps without tokens)"),
    ("model.moe.route_scale", *_POSITIVE),
    ("model.moe.expert_lr_max_scale", lambda v: v >= 1, "must be >= 1"),
    ("model.rope_theta", *_POSITIVE),
    ("model.norm_eps", *_POSITIVE),
    ("train.lr", *_POSITIVE),
    ("train.beta1", lambda v: 0 <= v < 1, "must be within [0, 1)"),
    ("train.beta2", lambda v: 0 <= v < 1, "must be within [0, 1)"),
    ("train.weight_decay", *_NOT_NEGATIVE),
    ("train.collective_timeout_s", lambda v: v > 0, "must be > 0 seconds"),
    ("train.min_lr_ratio", lambda v: 0 <= v <= 1, "must be within [0, 1]"),
    ("train.grad_clip", lambda v: v >= 0, "must be >= 0 (0 = no clipping)"),
    ("parallel.fsdp", lambda v: v >= 1 or v == -1, "must be >= 1, or -1 to fill the world size"),
    ("backend.fake_gate_noise", *_NOT_NEGATIVE),
    ("data.noise", lambda v: 0 <= v <= 1, "must be within [0, 1]"),
]


def _check_model(c: "Config") -> None:
    m, moe, b = c.model, c.model.moe, c.backend
    if moe.top_k > moe.num_experts:
        _fail("model.moe.top_k", moe.top_k,
              f"cannot exceed model.moe.num_experts={moe.num_experts}; lower top_k or add experts")
    if m.num_heads % m.num_kv_heads:
        _fail("model.num_kv_heads", m.num_kv_heads,
              f"must divide model.num_heads={m.num_heads} (grouped-query attention shares each kv head "
              f"by num_heads/num_kv_heads query heads)")
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
    if m.attention_sinks and b.attention not in ("eager", "flex"):
        _fail("backend.attention", b.attention,
              "attention sinks need backend.attention='eager' or 'flex' (SDPA has no sink logits)")
    rs = m.rope_scaling
    if rs.kind == "yarn":
        if rs.factor < 1:
            _fail("model.rope_scaling.factor", rs.factor, "must be >= 1 for yarn")
        if rs.original_max_len < 1 or rs.beta_fast <= 0 or rs.beta_slow <= 0:
            _fail("model.rope_scaling", f"original_max_len={rs.original_max_len} beta_fast={rs.beta_fast} "
                  f"beta_slow={rs.beta_slow}", "yarn needs original_max_len >= 1 and betas > 0")


def _check_routing(c: "Config") -> None:
    moe = c.model.moe
    if moe.num_experts % moe.num_groups:
        _fail("model.moe.num_groups", moe.num_groups, f"must divide model.moe.num_experts={moe.num_experts}")
    if not 1 <= moe.topk_groups <= moe.num_groups:
        _fail("model.moe.topk_groups", moe.topk_groups,
              f"must be between 1 and model.moe.num_groups={moe.num_groups}")
    if moe.num_groups > 1 and moe.top_k > moe.topk_groups * (moe.num_experts // moe.num_groups):
        _fail("model.moe.top_k", moe.top_k,
              "exceeds the experts in the topk_groups selected groups; raise model.moe.topk_groups")
    if moe.dynamic_capacity and moe.capacity_factor == 0:
        _fail("model.moe.dynamic_capacity", True, "needs model.moe.capacity_factor > 0 as its starting factor")
    if moe.score_func == "softmax_topk" and moe.num_groups > 1:
        _fail("model.moe.num_groups", moe.num_groups,
              "group-limited routing needs model.moe.score_func 'softmax' or 'sigmoid'; set num_groups=1")


def _check_train_and_layout(c: "Config") -> None:
    t, p, moe = c.train, c.parallel, c.model.moe
    if t.global_batch_size % t.micro_batch_size:
        _fail("train.global_batch_size", t.global_batch_size,
              f"must be a multiple of train.micro_batch_size={t.micro_batch_size}")
    if t.param_dtype == "bfloat16" and t.dtype != "bfloat16":
        _fail("train.param_dtype", t.param_dtype, "bf16 parameters need train.dtype=bfloat16")
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
    if c.data.kind == "tokens" and not c.data.path:
        _fail("data.path", c.data.path, "data.kind='tokens' needs data.path to a token file")


# Rules that tie fields together (each needs the values of _RANGES to be in range already).
_TIES = (_check_model, _check_routing, _check_train_and_layout)


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
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


# ---------------------------------------------------------------------- loading and saving
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
        data = yaml.safe_load(path.read_text())  # safe_load: a config never executes code
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
