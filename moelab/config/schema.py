"""moelab's one config dialect: typed dataclasses, YAML in and out, dotted overrides.

    cfg = load_config("tiny", overrides=["model.moe.num_experts=16", "train.steps=20"])
    cfg.model.moe.top_k            # 2
    save_config(cfg, "run/config.yaml"); load_config("run/config.yaml") == cfg   # True

Every value is checked when a Config is built (``Config.validate``), and every error names the field, the
value and the fix (`ConfigError`); layout checks that need the world size: moelab.layout.dims.ParallelDims.
Nothing here touches torch or hardware: a config can be built and planned on any machine.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from moelab.config.rules import ConfigError, _fail, check, shown  # noqa: F401 (ConfigError: moelab.config's name)
from moelab.config.lora import LoRAConfig, check_lora
from moelab.config.bounds import check_bounds, safe_name
from moelab.config.yaml_io import load_yaml, read_text


@dataclass
class MoEConfig:
    """The MoE layer: experts, routing, balancing (aux loss, z-loss, aux-loss-free bias), capacity.

        MoEConfig(num_experts=16, top_k=2, aux_loss_coeff=1e-3)   # or load_config("tiny", ["model.moe.top_k=1"])
    """
    num_experts: int = 8
    top_k: int = 2
    expert_ffn_size: int = 128
    num_shared_experts: int = 0
    # A registered score function (moelab.config.score_functions): softmax/sigmoid score all experts and pick the
    # top-k; softmax_topk (GPT-OSS) picks the top-k logits, then takes a softmax over those k only.
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    # Group-limited (two-level) routing: experts split into num_groups groups, tokens pick topk_groups first.
    num_groups: int = 1
    topk_groups: int = 1
    # Node-limited routing (DeepSeek-V3's device-limited routing): the experts split into routing_ranks equal
    # contiguous blocks (block r is what EP rank r holds when parallel.ep = routing_ranks); each token's experts
    # come from at most max_routed_ranks blocks, chosen by the sum of each block's ceil(top_k/max) best scores.
    # Defined on the experts alone, so one process routes exactly as EP does. 0 = off.
    max_routed_ranks: int = 0
    routing_ranks: int = 0
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
    # Router weights frozen: they get no update (their gradients are dropped before clipping and the optimizer
    # step); the expert bias still follows bias_update_rate. A live control (moelab.config.live) as well.
    freeze_router: bool = False
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
    against a world size by moelab.layout.dims.ParallelDims).

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
    # How the data-parallel ranks hold weights (moelab.parallel.replicate). data_parallel: dense weights sharded
    # (FSDP2) or replicated (DDP: bucketed all-reduce overlapped with backward, once per step). expert_dp: the
    # experts sharded over the expert-FSDP ranks (FSDP2), or replicated over them with moelab's own gradient
    # exchange after backward (the one train.expert_grad_compression can compress).
    data_parallel: Literal["fsdp", "ddp"] = "fsdp"
    expert_dp: Literal["fsdp", "replicate"] = "fsdp"
    # Two token chunks per micro batch after routing, one's all-to-all overlapping the other's experts (same math).
    ep_overlap: bool = False
    # How tokens reach the experts when the EP group spans nodes (moelab.parallel.ep_hierarchical). flat: one
    # all-to-all over the EP group, one row per routed expert. hierarchical: each token crosses to another node
    # once per destination node, fans out to its experts inside the node, and the node's weighted sum crosses
    # back once. auto: hierarchical when the EP group spans nodes, else flat.
    ep_dispatch: Literal["auto", "flat", "hierarchical"] = "auto"
    # Ranks per node (GPUs per host); 0 = the launcher's (LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE). Set it to
    # simulate nodes on one machine: ranks r and s share a node when r // ranks_per_node == s // ranks_per_node.
    ranks_per_node: int = 0
    # FSDP2 placement (moelab.parallel.fsdp; no value changes). Reshard after forward: default = torchtitan's rule
    # (every block but the last; none under pp > 1), for the dense blocks and the experts' own units.
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    expert_reshard_after_forward: Literal["default", "always", "never"] = "default"
    # The gradient reduce-scatter dtype: bfloat16 halves its bytes, rounding each gradient before the sum.
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    # All-gathers issued as the CPU reaches each unit (implicit) or a block ahead (explicit); auto = explicit
    # when ep > 1 (the dispatcher's host syncs hold the CPU back; torchtitan's rule).
    fsdp_prefetch: Literal["auto", "implicit", "explicit"] = "auto"
    # When FSDP2 reduce-scatters gradients with gradient accumulation (moelab.parallel.fsdp.set_micro_batch; same
    # math). micro_batch: every micro batch's backward, so only sharded gradients are ever held (FSDP2's and
    # torchtitan's default: they keep it for memory-bound runs, the reduce-scatter hidden behind backward).
    # step: the last micro batch's only (Megatron-Core's way, no_sync until the last); the others accumulate
    # unsharded gradients (in the reduce dtype) and leave their units gathered from backward to the next
    # forward (set_reshard_after_backward, as torch's pipeline schedule does): one reduce-scatter instead of m
    # and m+1 all-gathers instead of 2m per unit and step, for a stage's unsharded gradients and weights in
    # memory (the planner's held_unsharded). auto: micro_batch, and step under pp > 1, where torch's pipeline
    # schedule holds FSDP2's gradients to the last micro batch itself (micro_batch is refused there).
    fsdp_grad_sync: Literal["auto", "step", "micro_batch"] = "auto"
    # Shared experts under TP (moelab.parallel.tensor). replicate: each TP rank runs them whole on its sequence
    # shard (no collective; weights FSDP2-sharded over dp*cp*tp). column_row: gate/up column-, down row-parallel
    # between an all-gather of the shard's tokens and a reduce-scatter (torchtitan's; 4 more TP collectives per
    # MoE layer and micro batch for the same FLOPs: see docs/layouts.md). Nothing to choose at tp=1 or without
    # shared experts.
    tp_shared_experts: Literal["replicate", "column_row"] = "replicate"


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
    # Parameter (gradient, optimizer state) dtype: float32 = fp32 master weights, bf16 compute by autocast or FSDP2;
    # bfloat16 = stored in bf16 (as HF/torchtitan benchmarks run), no per-step casts; needs train.dtype=bfloat16.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # AdamW's state (moelab.planner.states): fp32 = fp32 master + fp32 moments; bf16_moments = fp32 master + bf16
    # moments (updated in fp32, stored rounded to nearest); bf16 = everything bf16 (needs param_dtype=bfloat16);
    # auto = the moments in param_dtype (fp32 for float32 parameters, bf16 for bfloat16 ones).
    optimizer_state: Literal["auto", "fp32", "bf16_moments", "bf16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False
    # AdamW's kernels (moelab.train.optim.build_optimizer): adamw = torch's (fused on CUDA, foreach on CPU);
    # adamw_triton = one Triton kernel per large tensor (moelab.train.adamw_triton; same math and state dict);
    # auto = adamw_triton on CUDA when Triton imports, else adamw.
    optimizer: Literal["auto", "adamw", "adamw_triton"] = "auto"
    # The optimizer step on a side stream, overlapped with the next step's forward (moelab.train.overlap): each
    # block's weights are updated in the forward's order and the forward waits for a block's update as it reaches
    # it. auto = on one CUDA process without a pipeline (elsewhere the step runs after the backward); off = never.
    # The update is the same, bitwise.
    optimizer_overlap: Literal["auto", "off"] = "auto"
    # FP8 (moelab.model.fp8): rowwise = e4m3 GEMMs scaled per row for the experts and the attention / dense
    # projections (router, norms, embedding, LM head in bf16); rowwise_lm_head adds the LM head (opt-in).
    # Where it pays (gallery/perf-notes.md, issue 41): at DeepSeek-V3's expert shapes (hidden 7168, expert width
    # 2048) an MoE layer's experts run 1.18x bf16 per micro batch, less the weights' quantisation once per step
    # (10.8 ms per layer on an H100): a gain from 4-5 micro batches per step; at the Qwen3-30B-A3B proxy's 0.99x.
    fp8: Literal["off", "rowwise", "rowwise_lm_head"] = "off"
    checkpoint_every: int = 0  # 0 = only on SIGTERM/SIGUSR1 and at the end
    keep_checkpoints: int = 2
    # False = never checkpoint (big benchmarks); a stop signal then just ends the run (PREEMPTED) at the step.
    save_checkpoints: bool = True
    on_nan: Literal["stop", "skip"] = "stop"
    # 1-bit expert gradients: with parallel.expert_dp=replicate the experts' gradient exchange sends sign bits and
    # one mean |g| per expert, with error feedback (moelab.parallel.compression). none = an exact mean.
    expert_grad_compression: Literal["none", "sign"] = "none"
    collective_timeout_s: float = 120.0
    # Held-out evaluation every eval_every steps (0 = never) on eval_batches global batches: `eval` events.
    eval_every: int = 0
    eval_batches: int = 4
    # Every expert_tokens_every steps (0 = never), which token ids each expert receives: expert_tokens.jsonl.
    expert_tokens_every: int = 0
    # Live mirrors of the metrics stream: RUN/tensorboard event files and W&B (offline: RUN/wandb; moelab[export]).
    tensorboard: bool = False
    wandb: Literal["off", "offline", "online"] = "off"
    init_from: str = ""  # "" = random (train.seed); "hf:/abs/path": an HF checkpoint (moelab.hf.sharded_load)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA fine-tuning, off by default (moelab.config.lora)


@dataclass
class BackendConfig:
    """The kernel switchboard. Availability of optional packages is checked by moelab.backends at run time.

        load_config("tiny", ["backend.attention=eager", "backend.fallback=true"]).backend
    """
    # auto: FlashAttention-4's kernels (fa4) where installed and they apply, else sdpa (moelab.backends.auto_attention);
    # sdpa and fa4: windows and sinks run eager, packed documents run flex on a GPU
    attention: Literal["auto", "sdpa", "fa4", "flex", "eager", "te"] = "auto"
    experts: Literal["auto", "grouped_mm", "loop", "grouped_gemm", "te", "triton_fused", "sonic"] = "auto"
    dispatcher: Literal["all_to_all", "deepep"] = "all_to_all"
    fake_balanced_gate: bool = False
    fake_gate_noise: float = 0.0
    fallback: bool = False  # True = an unavailable backend falls back to the torch path with a warning
    # TE's FP8 recipes for the attention projections of backend.attention=te: current (per-tensor current
    # scaling) or block (1x128 / 128x128 block scaling). moelab's own FP8 path is train.fp8.
    te_fp8: Literal["off", "current", "block"] = "off"
    # The LM head + loss (moelab.backends.loss): chunked = moelab's fused linear + cross-entropy, which never holds
    # the whole logits; full = the logits [tokens, vocabulary] then cross entropy; liger / cce = Liger Kernel's /
    # Apple cut-cross-entropy's fused kernels (optional packages, CUDA); auto = full where it is faster and fits
    # (compiled on CUDA, its plan within 85% of the GPU's memory), chunked everywhere else
    # (moelab.planner.plan.resolve_loss). loss_chunk_tokens: tokens per chunk of `chunked` (0 = auto: about 2**30
    # bytes of fp32 logits, moelab.planner.loss.chunk_tokens).
    loss: Literal["auto", "chunked", "full", "liger", "cce"] = "auto"
    loss_chunk_tokens: int = 0

    @property
    def router_kind(self) -> str:
        """How tokens are routed, as benchmark records and gallery rows state it: "learned" (the trained router),
        "fake_balanced" (round-robin, fake_balanced_gate) or "fake_noise=<x>" (round-robin shifted by
        fake_gate_noise). load_config("tiny", ["backend.fake_balanced_gate=true"]).backend.router_kind"""
        if not self.fake_balanced_gate:
            return "learned"
        return f"fake_noise={self.fake_gate_noise:g}" if self.fake_gate_noise > 0 else "fake_balanced"


@dataclass
class DataConfig:
    """Where the tokens come from: a synthetic Markov chain, uniform random tokens, a token file, text files or
    a Hugging Face dataset.

        load_config("tiny", ["data.kind=random"]).data
    """
    # synthetic: a learnable Markov chain; random: uniform tokens; tokens: a token file; text: text files
    # (moelab.data.corpus); hf: a Hugging Face dataset; sft: chats, loss on the responses (moelab.data.sft)
    kind: Literal["synthetic", "random", "tokens", "text", "hf", "sft"] = "synthetic"
    # tokens: a flat file of token ids; text: a file, folder, glob or "stdlib" (the demo corpus, no download);
    # hf: a dataset folder (save_to_disk) or a hub name; sft: a JSON lines file
    path: str = ""
    token_dtype: Literal["uint16", "uint32", "int32"] = "uint16"
    # text / hf: "bytes" (256 ids), "bpe" (trained on the corpus and cached), or a tokenizer.json / folder;
    # sft: a local transformers tokenizer folder (the checkpoint's), which has the chat template
    tokenizer: str = "bytes"
    bpe_vocab_size: int = 0  # 0 = model.vocab_size
    text_field: str = "text"  # JSON lines, Parquet and hf datasets: the field holding the text
    hf_split: str = "train"
    cache_dir: str = ""  # tokenised corpora; "" = $MOELAB_CACHE or ~/.cache/moelab
    # The validation split (train.eval_every): a share of the documents, or another corpus / token file.
    val_fraction: float = 0.0
    val_path: str = ""
    # synthetic: a fixed random Markov chain; each token follows its successor with prob 1 - noise.
    noise: float = 0.1
    chat_template: str = ""  # sft: a jinja chat template file, in place of the tokenizer's own (or its lack)
    # sft: several examples per row (attention kept within each, positions restart); false: one per row, padded
    sft_packing: bool = True


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
        """The config as nested dicts (what config.yaml holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """A Config from nested dicts, every value checked (ConfigError naming field, value and fix)."""
        return _build(cls, d, "")

    def replace(self, **dotted: Any) -> "Config":
        """A copy with dotted keys replaced: ``cfg.replace(**{"train.steps": 5})``."""
        d = self.to_dict()
        for key, value in dotted.items():
            _set_dotted(d, key, value)
        return Config.from_dict(d)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the field, the value and the fix (the rules: moelab.config.rules)."""
        check_bounds(self)  # first: some rules loop over divisors of these sizes
        check(self)
        check_lora(self)


# ---------------------------------------------------------------------- building from dicts (YAML, CLI)
@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    """A config class's field types (typing.get_type_hints evaluates the annotations' strings: once per class)."""
    return typing.get_type_hints(cls)


def _build(cls, d: Any, prefix: str):
    if not isinstance(d, dict):
        _fail(prefix.rstrip(".") or "config", d, f"expected a mapping of {cls.__name__} fields")
    hints = _hints(cls)
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
        if isinstance(value, bool) and ("off" if value is False else "on") in choices:
            value = "off" if value is False else "on"  # YAML 1.1 reads a bare off/on as a boolean
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
        raise ConfigError(f"--set {shown(text)}: expected KEY=VALUE, for example model.moe.num_experts=16")
    key, raw = text.split("=", 1)
    try:
        value = load_yaml(raw, f"--set {key.strip()}", file=False) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


# ---------------------------------------------------------------------- loading and saving
def load_config(source: "str | Path | Config | dict", overrides: "list[str] | dict | None" = None,
                readers: "dict | None" = None) -> Config:
    """A Config from a preset name, a YAML path, a dict or a Config, with dotted overrides applied. `readers`
    ({"hf": fn}; Session and the CLI pass moelab.run.session.SOURCE_READERS) reads `hf:PATH` and `base: hf:PATH`.

        load_config("tiny", ["train.steps=20"])
        load_config("my.yaml", {"parallel.ep": 2})
    """
    if isinstance(source, Config):
        d = source.to_dict()
    elif isinstance(source, dict):
        d = Config.from_dict(source).to_dict()
    else:
        d = _read_source(str(source), readers=readers or {})
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or [])
    for key, value in items:
        _set_dotted(d, key, value)
    return Config.from_dict(d)


def _read_source(source: str, _seen: tuple = (), readers: "dict | None" = None) -> dict:
    from moelab.presets import preset_names, preset_path

    if source.startswith("hf:"):
        if "hf" not in (readers or {}):
            raise ConfigError(f"{source!r}: hf: checkpoints are read by moelab.Session, `moelab run` and "
                              f"moelab.hf.source.load_config; pass readers=moelab.run.session.SOURCE_READERS")
        return readers["hf"](source)
    if "\0" in source or len(source) > 4096:
        raise ConfigError(f"config source {shown(source)}: not a preset name or a path (a NUL byte, or longer "
                          f"than a path can be)")
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
        data = load_yaml(read_text(path), str(path))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {shown(str(e), 300)}") from None
    if not data:  # an empty or comment-only file would silently train the built-in default model
        raise ConfigError(f"{path}: the file sets nothing; give at least `base: PRESET` (see `moelab presets`)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    data.setdefault("name", safe_name(path.stem))
    base = data.pop("base", None)  # a YAML file may start from a preset: `base: qwen3-moe-30b-a3b`
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: base={shown(base)}: expected a preset name or a YAML path")
    if path.resolve() in _seen:
        raise ConfigError(f"{path}: its `base:` chain loops back to this file; break the loop")
    d = _read_source(base, _seen + (path.resolve(),), readers) if base else Config().to_dict()
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
    *parts, last = dotted.split(".")
    node = d
    for p in parts:
        node = node.setdefault(p, {})
    node[last] = value
    return d


def save_config(cfg: Config, path: "str | Path") -> None:
    """Write `cfg` as YAML to `path` atomically (moelab.contract.writes)."""
    from moelab.contract.writes import write_atomic  # a run folder's writes go through one place

    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
