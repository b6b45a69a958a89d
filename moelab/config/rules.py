"""The rules a Config obeys, checked when one is built (Config.validate): each error names the field, the value
and the fix. Layout rules that need the world size are moelab.layout.dims (ParallelDims).

    check(load_config("tiny"))                        # passes
    Session("tiny", train={"steps": 0})               # ConfigError: train.steps=0: must be >= 1
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import fields
from typing import Any

from moelab.config.score_functions import SCORE_FUNCTIONS


class ConfigError(ValueError):
    """An invalid config value. The message names the field, the value and the fix.

        Session("tiny", train={"steps": 0})   # ConfigError: train.steps=0: must be >= 1
    """

    MAX_CHARS = 1000  # a message stays readable: a longer one keeps its start and end

    def __init__(self, message: str = ""):
        message = str(message)
        if len(message) > self.MAX_CHARS:
            message = f"{message[:700]} ... ({len(message)} characters) ... {message[-200:]}"
        super().__init__(message)

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
    raise ConfigError(f"{field_name}={shown(value)}: {fix}")


def shown(value: Any, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters, saying how long it was: an error stays one readable line (a 1 MB
    value is not echoed back)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _sections(obj, prefix: str = ""):
    """(dotted name, dataclass) for every section of a config, nested ones included."""
    yield prefix.rstrip("."), obj
    for f in fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from _sections(v, f"{prefix}{f.name}.")


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending (sqrt(n) steps: n may be as large as the bounds allow)."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def check(cfg) -> None:
    """Every rule of Config.validate (ConfigError naming the field, the value and the fix), section by section;
    the bounds (moelab.config.bounds) ran first."""
    m, moe, p, t, b = cfg.model, cfg.model.moe, cfg.parallel, cfg.train, cfg.backend
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
    for section, obj in _sections(cfg):
        for f in fields(obj):
            v = getattr(obj, f.name)
            if f.type in ("int", int) and f.name not in ("fsdp", "seed", "pad_token_id") and v < 0 \
                    and f"{section}.{f.name}" not in at_least_one:
                _fail(f"{section}.{f.name}", v, "must be >= 0")
    for name, v in _positive:
        if v < 1:
            _fail(name, v, "must be >= 1")
    _check_model(m)
    _check_moe(moe, p, b)
    _check_train(t, b)
    _check_parallel(cfg)
    _check_backend(cfg)
    _check_data(cfg)


def _check_model(m: "ModelConfig") -> None:
    """model.*: attention shapes, dense layers, rotary embeddings (model.moe: _check_moe)."""
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
    for name, v in (("model.rope_theta", m.rope_theta), ("model.norm_eps", m.norm_eps)):
        if v <= 0:
            _fail(name, v, "must be > 0")
    rs = m.rope_scaling
    if rs.kind == "yarn":
        if rs.factor < 1:
            _fail("model.rope_scaling.factor", rs.factor, "must be >= 1 for yarn")
        if rs.original_max_len < 1 or rs.beta_fast <= 0 or rs.beta_slow <= 0:
            _fail("model.rope_scaling", f"original_max_len={rs.original_max_len} beta_fast={rs.beta_fast} "
                  f"beta_slow={rs.beta_slow}", "yarn needs original_max_len >= 1 and betas > 0")


def _check_moe(moe: "MoEConfig", p: "ParallelConfig", b: "BackendConfig") -> None:
    """model.moe.*: routing (top-k, groups, node limits), balancing, capacity, per-expert learning rates."""
    if moe.top_k > moe.num_experts:
        _fail("model.moe.top_k", moe.top_k,
              f"cannot exceed model.moe.num_experts={moe.num_experts}; lower top_k or add experts")
    if moe.num_experts % moe.num_groups:
        _fail("model.moe.num_groups", moe.num_groups, f"must divide model.moe.num_experts={moe.num_experts}")
    if not 1 <= moe.topk_groups <= moe.num_groups:
        _fail("model.moe.topk_groups", moe.topk_groups,
              f"must be between 1 and model.moe.num_groups={moe.num_groups}")
    if moe.num_groups > 1 and moe.top_k > moe.topk_groups * (moe.num_experts // moe.num_groups):
        _fail("model.moe.top_k", moe.top_k,
              "exceeds the experts in the topk_groups selected groups; raise model.moe.topk_groups")
    check_score_func(moe)
    _check_node_limited(moe, p, b)
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
    if moe.expert_lr_max_scale < 1:
        _fail("model.moe.expert_lr_max_scale", moe.expert_lr_max_scale, "must be >= 1")


def _check_train(t: "TrainConfig", b: "BackendConfig") -> None:
    """train.*: batches, optimizer, dtypes and FP8, checkpoints."""
    if t.global_batch_size % t.micro_batch_size:
        _fail("train.global_batch_size", t.global_batch_size,
              f"must be a multiple of train.micro_batch_size={t.micro_batch_size}")
    if t.lr < 0:
        _fail("train.lr", t.lr, "must be >= 0 (0 keeps the weights where they start, e.g. to check a loaded "
              "checkpoint)")
    if t.init_from and not t.init_from.startswith("hf:"):
        _fail("train.init_from", t.init_from, "give '' (random weights from train.seed) or hf:PATH (a Hugging "
              "Face checkpoint folder)")
    for name, v, ok, fix in (("train.beta1", t.beta1, 0 <= t.beta1 < 1, "must be within [0, 1)"),
                             ("train.beta2", t.beta2, 0 <= t.beta2 < 1, "must be within [0, 1)"),
                             ("train.weight_decay", t.weight_decay, t.weight_decay >= 0, "must be >= 0"),
                             ("train.collective_timeout_s", t.collective_timeout_s,
                              t.collective_timeout_s > 0, "must be > 0 seconds")):
        if not ok:
            _fail(name, v, fix)
    if not 0 <= t.min_lr_ratio <= 1:
        _fail("train.min_lr_ratio", t.min_lr_ratio, "must be within [0, 1]")
    if t.grad_clip < 0:
        _fail("train.grad_clip", t.grad_clip, "must be >= 0 (0 = no clipping)")
    if t.param_dtype == "bfloat16" and t.dtype != "bfloat16":
        _fail("train.param_dtype", t.param_dtype, "bf16 parameters need train.dtype=bfloat16")
    if t.optimizer_state == "bf16" and t.param_dtype != "bfloat16":
        _fail("train.optimizer_state", t.optimizer_state, "everything in bf16 means bf16 weights: set "
              "train.param_dtype=bfloat16 too, or train.optimizer_state=bf16_moments to keep the fp32 master")
    if t.optimizer_state in ("fp32", "bf16_moments") and t.param_dtype == "bfloat16":
        _fail("train.optimizer_state", t.optimizer_state, "train.param_dtype=bfloat16 keeps no fp32 master "
              "weights: set train.optimizer_state=bf16 (or auto), or train.param_dtype=float32")
    if t.fp8 != "off" and t.dtype != "bfloat16":
        _fail("train.fp8", t.fp8, "FP8 training computes in bf16 around its FP8 GEMMs: set train.dtype=bfloat16")
    if t.fp8 != "off" and b.experts not in ("auto", "grouped_mm"):
        _fail("train.fp8", t.fp8, f"FP8 experts run their own grouped GEMMs, not backend.experts={b.experts!r}; "
              "set backend.experts=auto (or train.fp8=off)")
    if t.fp8 == "rowwise_lm_head" and b.loss not in ("full", "auto"):
        _fail("train.fp8", t.fp8, f"the FP8 LM head is the head GEMM of backend.loss=full; backend.loss={b.loss!r} "
              "computes the head inside its fused loss in bf16: set backend.loss=full (or train.fp8=rowwise)")
    if b.loss_chunk_tokens < 0:
        _fail("backend.loss_chunk_tokens", b.loss_chunk_tokens, "must be >= 0 (0 = auto)")
    if t.fp8 != "off" and t.device == "cpu":
        _fail("train.fp8", t.fp8, "FP8 GEMMs need a CUDA GPU of compute capability 9.0+ (Hopper); set "
              "train.fp8=off on CPU")
    if t.keep_checkpoints < 1:
        _fail("train.keep_checkpoints", t.keep_checkpoints, "must be >= 1")


def _check_parallel(cfg: "Config") -> None:
    """parallel.*: the layout's own rules (those that need the world size: moelab.layout.dims)."""
    p, t, moe = cfg.parallel, cfg.train, cfg.model.moe
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
        _check_tensor_parallel(cfg)
    if p.tp_shared_experts == "column_row" and (p.tp == 1 or moe.num_shared_experts == 0):
        _fail("parallel.tp_shared_experts", p.tp_shared_experts, "splits shared experts over TP ranks: it needs "
              f"parallel.tp > 1 (tp={p.tp}) and model.moe.num_shared_experts > 0 (here "
              f"{moe.num_shared_experts}); leave it at 'replicate'")
    _check_replication(p, t)
    _check_ep_overlap(p, cfg.backend)
    _check_ep_dispatch(p, cfg.backend)
    _check_grad_sync(p)


def _tp_unsupported(cfg: "Config") -> list[tuple[str, object, str]]:
    """(field, value, fix) of each setting tensor parallelism (moelab.parallel.tensor) does not run with yet."""
    p, t, b = cfg.parallel, cfg.train, cfg.backend
    return [(name, value, fix) for name, value, bad, fix in [
        ("parallel.data_parallel", p.data_parallel, p.data_parallel != "fsdp", "set parallel.data_parallel=fsdp "
         "(FSDP2 on the 2-D dp x tp mesh; DDP all-reduces plain gradients over one process group, while TP's "
         "weights are DTensors and those replicated over the TP ranks (norms, routers, shared experts) need a "
         "second sum over them, which DDP does not do; torchtitan refuses DDP with any second mesh dimension too)"),
        ("backend.loss", b.loss, b.loss not in ("chunked", "full", "auto"), "set backend.loss=chunked (moelab's "
         "fused loss, on this rank's vocabulary rows) or full (the loss on vocabulary-sharded logits): "
         f"{b.loss}'s kernel computes the whole vocabulary's log-sum-exp on one GPU"),
        ("backend.attention", b.attention, b.attention == "te", "set backend.attention=sdpa (Transformer Engine "
         "runs on CUDA GPUs only, and its Linear projections are not split by heads under TP: that needs several "
         "GPUs to build and prove, which this project's tests do not have)"),
        ("train.fp8", t.fp8, t.fp8 != "off", "set train.fp8=off (FP8 GEMMs run on Hopper GPUs only, and FP8's "
         "projections are not column/row-parallel DTensors under TP: that needs several GPUs to build and prove, "
         "which this project's tests do not have)"),
    ] if bad]


def _check_tensor_parallel(cfg: "Config") -> None:
    """parallel.tp > 1: what moelab.parallel.tensor does not run with yet, each refused by name (the divisibility
    rules need no world size either, but live with the layout: moelab.layout.dims)."""
    unsupported = _tp_unsupported(cfg)
    if unsupported:
        name, value, fix = unsupported[0]
        _fail(name, value, f"does not run with parallel.tp={cfg.parallel.tp} yet; {fix}")


def _check_grad_sync(p: ParallelConfig) -> None:
    """parallel.fsdp_grad_sync (moelab.layout.dims.grad_sync): what torch's pipeline schedule allows, and an
    FSDP2 unit to apply it to."""
    if p.fsdp_grad_sync == "micro_batch" and p.pp > 1:
        _fail("parallel.fsdp_grad_sync", p.fsdp_grad_sync, f"torch's pipeline schedule (pp={p.pp}) holds FSDP2's "
              "gradients unsharded until the step's last backward and reduce-scatters them once per step "
              "(PipelineStage.backward_maybe_with_nosync); set parallel.fsdp_grad_sync=auto (or step), or "
              "parallel.pp=1")
    if p.fsdp_grad_sync == "step" and (p.data_parallel, p.expert_dp) == ("ddp", "replicate"):
        _fail("parallel.fsdp_grad_sync", p.fsdp_grad_sync, "applies to FSDP2's weights, and with "
              "parallel.data_parallel=ddp and expert_dp=replicate there are none (DDP and the experts' exchange "
              "reduce once per step already); set parallel.fsdp_grad_sync=auto")


def _check_backend(cfg: "Config") -> None:
    """backend.*: what each kernel choice takes (its package: moelab.backends, checked by the preflight)."""
    m, b = cfg.model, cfg.backend
    if m.attention_sinks and b.attention not in ("eager", "flex", "te"):
        _fail("backend.attention", b.attention,
              "attention sinks need backend.attention='eager', 'flex' or 'te' (SDPA has no sink logits)")
    if b.te_fp8 != "off" and (b.attention != "te" or m.attention == "mla"):
        _fail("backend.te_fp8", b.te_fp8, "TE's FP8 recipes run the TE Linear projections of "
              "backend.attention='te' on GQA/MHA models; set backend.attention=te, or backend.te_fp8=off")
    if b.fake_gate_noise < 0:
        _fail("backend.fake_gate_noise", b.fake_gate_noise, "must be >= 0")
    if b.fake_gate_noise > 0 and not b.fake_balanced_gate:
        _fail("backend.fake_gate_noise", b.fake_gate_noise, "only shifts the fake balanced gate's round-robin "
              "routing; set backend.fake_balanced_gate=true as well, or leave the noise at 0 for the learned router")
    _check_deepep(cfg)


def _check_data(cfg: "Config") -> None:
    """data.*: the kind and its paths, evaluation splits, noise."""
    if cfg.data.kind == "tokens" and not cfg.data.path:
        _fail("data.path", cfg.data.path, "data.kind='tokens' needs data.path to a token file")
    _validate_data(cfg)
    if not 0 <= cfg.data.noise <= 1:
        _fail("data.noise", cfg.data.noise, "must be within [0, 1]")




def _validate_data(cfg: "Config") -> None:
    """The data and evaluation fields (the files themselves are checked by moelab.data.batches.check_data)."""
    d, t = cfg.data, cfg.train
    if d.kind in ("text", "hf") and not d.path:
        _fail("data.path", d.path, f"data.kind={d.kind!r} needs data.path: "
              + ("a text file, folder, glob or 'stdlib' (the demo corpus)" if d.kind == "text"
                 else "a dataset folder (save_to_disk) or a hub name"))
    if not 0 <= d.val_fraction < 1:
        _fail("data.val_fraction", d.val_fraction, "must be within [0, 1) (the share of documents held out)")
    if d.val_fraction and d.val_path:
        _fail("data.val_fraction", d.val_fraction, "give data.val_fraction or data.val_path, not both")
    if d.val_fraction and d.kind not in ("text", "hf"):
        _fail("data.val_fraction", d.val_fraction, f"splits documents of data.kind 'text' or 'hf'; data.kind="
              f"{d.kind!r} " + ("takes data.val_path (a token file)" if d.kind == "tokens" else
                                 "draws held-out samples by itself: set data.val_fraction=0"))
    if d.val_path and d.kind in ("synthetic", "random"):
        _fail("data.val_path", d.val_path, f"data.kind={d.kind!r} draws held-out samples by itself; clear it")
    if t.eval_every and d.kind in ("text", "hf", "tokens") and not (d.val_fraction or d.val_path):
        _fail("train.eval_every", t.eval_every, "needs a validation split: set data.val_fraction (e.g. 0.05) "
              "or data.val_path")
    if t.eval_every and t.eval_batches < 1:
        _fail("train.eval_batches", t.eval_batches, "must be >= 1 when train.eval_every > 0")
    for name in ("eval_every", "expert_tokens_every"):
        if getattr(t, name) and cfg.parallel.pp > 1:
            _fail(f"train.{name}", getattr(t, name), "is not supported with pipeline parallelism yet; set "
                  "parallel.pp=1 or 0 here")
    if d.kind == "sft":
        _validate_sft(cfg)
    elif d.chat_template:
        _fail("data.chat_template", d.chat_template, f"renders data.kind='sft' only (data.kind={d.kind!r}); clear it")


def _validate_sft(cfg: "Config") -> None:
    """Instruction data (moelab.data.sft; the file and the tokenizer are checked by check_data)."""
    d, t, p = cfg.data, cfg.train, cfg.parallel
    if not d.path:
        _fail("data.path", d.path, "data.kind='sft' needs data.path: a JSON lines file of {\"messages\": [...]} "
              "or {\"prompt\": ..., \"response\": ...} records")
    # left at its default ("bytes") in a run from hf:PATH, the checkpoint folder is the tokenizer (check_data
    # refuses a folder without tokenizer files)
    if d.tokenizer == "bpe" or (d.tokenizer == "bytes" and not t.init_from.startswith("hf:")):
        _fail("data.tokenizer", d.tokenizer, "data.kind='sft' renders chats with a transformers tokenizer: give a "
              "local tokenizer folder (the checkpoint's: tokenizer.json, tokenizer_config.json), or start "
              "from hf:PATH, whose folder is the default")
    for name, value in (("parallel.pp", p.pp), ("parallel.cp", p.cp)):
        if value > 1:
            _fail(name, value, "data.kind='sft' is not supported with pipeline or context parallelism yet "
                  "(its batches carry loss masks and document boundaries); set it to 1 (fsdp, ep and tp work)")
    for name in ("eval_every", "expert_tokens_every"):
        if getattr(t, name):
            _fail(f"train.{name}", getattr(t, name), "is not supported with data.kind='sft' yet; set it to 0")
    if d.val_path:
        _fail("data.val_path", d.val_path, "data.kind='sft' has no evaluation split yet; clear it")
    if d.sft_packing and cfg.backend.attention == "te":
        _fail("data.sft_packing", d.sft_packing, "packed examples need a document mask, which "
              "backend.attention='te' does not take here; set data.sft_packing=false or another backend")


def check_score_func(moe: "MoEConfig") -> None:
    """model.moe.score_func names a registered score function, which routes group-limited if num_groups > 1
    (the config's rule, and the router's check of a MoEConfig built without a Config)."""
    if moe.score_func not in SCORE_FUNCTIONS:
        close = difflib.get_close_matches(str(moe.score_func), sorted(SCORE_FUNCTIONS), n=1)
        _fail("model.moe.score_func", moe.score_func,
              f"choose one of {sorted(SCORE_FUNCTIONS)}" + (f" (did you mean {close[0]!r}?)" if close else "")
              + "; a new one is registered with moelab.config.score_functions.register_score_function")
    if moe.num_groups > 1 and not SCORE_FUNCTIONS[moe.score_func].group_limited:
        able = sorted(name for name, fn in SCORE_FUNCTIONS.items() if fn.group_limited)
        _fail("model.moe.num_groups", moe.num_groups,
              f"model.moe.score_func={moe.score_func!r} cannot route group-limited; set num_groups=1 or use one "
              f"of {able}")


def _check_node_limited(moe: MoEConfig, p: ParallelConfig, b: BackendConfig) -> None:
    """model.moe.max_routed_ranks / routing_ranks: node-limited routing, refused where it would not bound
    the fan-out or would be ignored."""
    M, R = moe.max_routed_ranks, moe.routing_ranks
    if M == 0:
        if R:
            _fail("model.moe.routing_ranks", R, "has no effect without model.moe.max_routed_ranks > 0; set it to 0 "
                  "or set max_routed_ranks")
        return
    if R < 2 or moe.num_experts % R:
        _fail("model.moe.routing_ranks", R, f"node-limited routing needs routing_ranks >= 2 dividing "
              f"model.moe.num_experts={moe.num_experts} (the EP ranks the limit counts); try one of "
              f"{[d for d in _divisors(moe.num_experts) if d > 1]}")
    if M >= R:
        _fail("model.moe.max_routed_ranks", M, f"must be below model.moe.routing_ranks={R} to limit anything; "
              f"set it to 0 (no limit) or lower it")
    if moe.top_k > M * (moe.num_experts // R):
        _fail("model.moe.top_k", moe.top_k, f"exceeds the {M * (moe.num_experts // R)} experts on "
              f"max_routed_ranks={M} ranks; raise model.moe.max_routed_ranks")
    if moe.num_groups > 1:
        _fail("model.moe.num_groups", moe.num_groups, "group-limited and node-limited routing do not combine; "
              "use one (num_groups=1, or max_routed_ranks=0)")
    if b.fake_balanced_gate:
        _fail("backend.fake_balanced_gate", True, "the round-robin gate ignores model.moe.max_routed_ranks; "
              "turn one of them off")
    if R % p.ep:
        _fail("parallel.ep", p.ep, f"must divide model.moe.routing_ranks={R}, so that each EP rank holds whole "
              f"routing blocks and a token reaches at most max_routed_ranks={M} ranks")


def _check_ep_overlap(p: ParallelConfig, b: BackendConfig) -> None:
    """parallel.ep_overlap: the all-to-all dispatcher split in two chunks (moelab.parallel.expert_parallel)."""
    if not p.ep_overlap:
        return
    if p.ep == 1:
        _fail("parallel.ep_overlap", True, "overlaps the expert-parallel all-to-all, which needs parallel.ep > 1; "
              "set parallel.ep (e.g. 2) or parallel.ep_overlap=false")
    if b.dispatcher != "all_to_all":
        _fail("parallel.ep_overlap", True, f"splits backend.dispatcher='all_to_all''s exchanges, not "
              f"backend.dispatcher={b.dispatcher!r}'s kernels; set backend.dispatcher=all_to_all or "
              f"parallel.ep_overlap=false")


def _check_ep_dispatch(p: ParallelConfig, b: BackendConfig) -> None:
    """parallel.ep_dispatch / ranks_per_node: the node-aware dispatcher (moelab.parallel.ep_hierarchical) is
    built on the all-to-all path; how nodes split the ranks is checked against a world size by
    moelab.layout.dims.ParallelDims."""
    if p.ranks_per_node < 0:
        _fail("parallel.ranks_per_node", p.ranks_per_node, "must be >= 1, or 0 to take the launcher's count")
    if p.ep_dispatch != "hierarchical":
        return
    if p.ep == 1:
        _fail("parallel.ep_dispatch", p.ep_dispatch, "routes tokens between expert-parallel ranks, which needs "
              "parallel.ep > 1; set parallel.ep or parallel.ep_dispatch=auto")
    if b.dispatcher != "all_to_all":
        _fail("parallel.ep_dispatch", p.ep_dispatch, f"is built from torch all-to-alls, not "
              f"backend.dispatcher={b.dispatcher!r}'s kernels; set backend.dispatcher=all_to_all or "
              f"parallel.ep_dispatch=flat")


def _check_replication(p: ParallelConfig, t: TrainConfig) -> None:
    """parallel.data_parallel / expert_dp and train.expert_grad_compression: the combinations moelab runs."""
    if t.expert_grad_compression != "none" and p.expert_dp != "replicate":
        _fail("train.expert_grad_compression", t.expert_grad_compression, "compresses moelab's exchange of "
              "replicated expert gradients; set parallel.expert_dp=replicate (FSDP2's reduce-scatter is exact)")
    for name, value, default in (("parallel.data_parallel", p.data_parallel, "fsdp"),
                                 ("parallel.expert_dp", p.expert_dp, "fsdp")):
        if value != default and (p.pp > 1 or p.cp > 1):
            _fail(name, value, f"runs without pipeline and context parallelism (pp={p.pp}, cp={p.cp}); "
                  f"set {name}={default} or pp=cp=1")
    if p.expert_dp == "replicate" and p.data_parallel == "fsdp" and t.dtype == "bfloat16":
        _fail("parallel.expert_dp", p.expert_dp, "with FSDP2's bf16 mixed precision the replicated experts would "
              "stay fp32; set parallel.data_parallel=ddp (autocast) or train.dtype=float32")
    if p.reduce_dtype != "float32" and (p.data_parallel, p.expert_dp) != ("fsdp", "fsdp"):
        name, value = (("parallel.data_parallel", p.data_parallel) if p.data_parallel != "fsdp"
                       else ("parallel.expert_dp", p.expert_dp))
        _fail("parallel.reduce_dtype", p.reduce_dtype, f"is FSDP2's gradient reduce-scatter dtype, and {name}="
              f"{value} reduces its gradients in fp32 outside FSDP2; set parallel.reduce_dtype=float32 or "
              f"{name}=fsdp")


DEEPEP_EP = (2, 4, 8)  # the EP sizes DeepEP's intranode kernels are instantiated for (one node, NVLink)


def _check_deepep(cfg: "Config") -> None:
    """backend.dispatcher=deepep: the layouts and shapes DeepEP's intranode kernels take (its package and the
    GPU are checked at run time by moelab.backends.check_backends, with backend.fallback)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if cfg.backend.dispatcher != "deepep":
        return
    fix = "or set backend.dispatcher=all_to_all"
    if p.ep not in DEEPEP_EP:
        _fail("parallel.ep", p.ep, f"backend.dispatcher=deepep runs DeepEP's intranode kernels, built for 2, 4 or 8 "
              f"EP ranks on one node; set parallel.ep to one of {[e for e in DEEPEP_EP if m.moe.num_experts % e == 0]}"
              f", {fix}")
    if t.dtype != "bfloat16" or p.data_parallel != "fsdp":
        name, value = ("train.dtype", t.dtype) if t.dtype != "bfloat16" else ("parallel.data_parallel", p.data_parallel)
        _fail(name, value, f"backend.dispatcher=deepep needs bf16 activations (DeepEP's combine sums bf16 rows): "
              f"set train.dtype=bfloat16 with parallel.data_parallel=fsdp, {fix}")
    if m.hidden_size % 16 or m.hidden_size > 8176:
        _fail("model.hidden_size", m.hidden_size, f"DeepEP's intranode dispatch moves bf16 rows in 32-byte steps of "
              f"at most 16 KB: the hidden size must be a multiple of 16 and at most 8176; {fix}")
    if m.moe.top_k > 32:
        _fail("model.moe.top_k", m.moe.top_k, f"DeepEP's kernels take at most 32 experts per token; {fix}")
