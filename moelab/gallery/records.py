"""What a benchmark record ran, and how a row says it.

Every record states its router kind (``router``: "learned", "fake_balanced" or "fake_noise=<x>", from
``BackendConfig.router_kind`` of the config that ran); a record written before that field existed gets it inferred
from what it recorded (its fake_balanced_gate / fake_gate_noise fields, its ``--set`` overrides, its gallery entry,
its preset's default), and the row says "(inferred)" (``RouterOf.source`` says from what). Which records the
tables show as current is moelab.gallery.current's rule. A fake_gate_noise sweep (gallery/scripts/router_sweep.py)
renders as "what imbalance costs".
``rebuild_config`` gives the config a record ran (the planned-vs-measured tables plan it), ``planner_options`` the
planner options that plan it as the code of its day ran (CODE_BEFORE: what changed in the code, not in a config).

    router_of(record, entries)            # RouterOf(kind="fake_balanced", inferred=True); str() -> "... (inferred)"
    cfg, why_not = rebuild_config(record, entries)    # (Config, "") or (None, the reason)
    plan(cfg, gpus=record["gpus"], **planner_options(record))   # a record from before 6131a2c: fsdp_one_rank=wrapped
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from moelab.config import BackendConfig, Config, ConfigError, load_config

SWEEP = "router"  # the `sweep` field of router_sweep.py's records


@dataclass(frozen=True)
class RouterOf:
    """A record's router kind, whether it had to be inferred (the record predates the `router` field) and from
    what (`source`: "router field", "fake_balanced_gate field", "--set override", "gallery entry", "preset default",
    "moelab's default"; not compared).

        str(RouterOf("learned", inferred=True))     # 'learned (inferred)'
        RouterOf("learned", True, "preset default").how    # 'learned (inferred from the preset default)'
    """
    kind: str
    inferred: bool
    source: str = field(default="", compare=False)

    def __str__(self) -> str:
        return self.kind + (" (inferred)" if self.inferred else "")

    @property
    def how(self) -> str:
        """The kind and, when inferred, what it was inferred from."""
        return self.kind + (f" (inferred from the {self.source})" if self.inferred and self.source else
                            " (inferred)" if self.inferred else "")


def recorded_overrides(r: dict) -> dict:
    """The dotted overrides a record names: its `overrides` list and the `--set k=v` of its command."""
    items = [str(x) for x in r.get("overrides") or [] if "=" in str(x)]
    try:
        words = shlex.split(str(r.get("command") or ""))
    except ValueError:
        words = []
    items += [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set" and "=" in words[i + 1]]
    return dict(x.split("=", 1) for x in items)


def router_of(r: dict, entries: "dict | None" = None) -> RouterOf:
    """The router kind of a result record: its `router` field, else inferred from (in order) its recorded
    fake_balanced_gate / fake_gate_noise, its recorded overrides, its gallery entry's config, or the default of
    the preset or `moelab` command it ran; "unknown" where none of these says."""
    if r.get("router"):  # the spelling of gpu_perf.py's first records ("fake balanced", "fake with noise 0.5") too
        kind = re.sub(r"^fake with noise ", "fake_noise=", str(r["router"])).replace("fake balanced", "fake_balanced")
        return RouterOf(kind, inferred=False, source="router field")
    over = recorded_overrides(r)
    gate, noise = r.get("fake_balanced_gate"), r.get("fake_gate_noise")
    source = "fake_balanced_gate field"
    if gate is None and "backend.fake_balanced_gate" in over:
        gate, source = over["backend.fake_balanced_gate"].lower() in ("true", "1", "yes"), "--set override"
    if noise is None and "backend.fake_gate_noise" in over:
        noise = float(over["backend.fake_gate_noise"])
    if gate is None and entries and r.get("workload") in entries:
        try:
            return RouterOf(entries[r["workload"]].config().backend.router_kind, inferred=True,
                            source="gallery entry")
        except ConfigError:
            pass
    if gate is None:
        try:
            base, source = load_config(r.get("preset", r.get("workload"))).backend, "preset default"
        except (ConfigError, KeyError, TypeError, ValueError, OSError):
            moelab = over or str(r.get("command", "")).startswith("moelab ")
            base, source = (BackendConfig(), "moelab's default") if moelab else (None, "")
        if base is None:
            return RouterOf("unknown", inferred=True)
        gate = base.fake_balanced_gate
        noise = base.fake_gate_noise if noise is None else noise
    return RouterOf(BackendConfig(fake_balanced_gate=bool(gate), fake_gate_noise=float(noise or 0)).router_kind,
                    inferred=True, source=source)


# ---------------------------------------------------------------------- the config a record ran
_RESULT_OVERRIDES = {"global_batch_size": "train.global_batch_size", "micro_batch_size": "train.micro_batch_size",
                     "seq_len": "train.seq_len", "dtype": "train.dtype", "param_dtype": "train.param_dtype",
                     "activation_checkpointing": "train.activation_checkpointing", "compile": "train.compile",
                     "fake_balanced_gate": "backend.fake_balanced_gate", "fake_gate_noise": "backend.fake_gate_noise",
                     "optimizer_state": "train.optimizer_state", "fp8": "train.fp8",
                     "loss_chunk_tokens": "backend.loss_chunk_tokens", "grad_clip": "train.grad_clip"}
REBUILD_KEYS = ("global_batch_size", "micro_batch_size", "seq_len", "dtype", "param_dtype", "layout")
# what changed a default that records did not write down: records older than the commit's date ran the old value
# (the record field, its value before, the commit, its date)
DEFAULTS_BEFORE = (("loss", "full", "f0b7924", "2026-12-01T21:41"),  # the chunked loss became the default
                   ("optimizer", "adamw", "258d1aa", "2026-12-01T21:53"),  # TritonAdamW became auto's kernel
                   # the optimizer step overlapped with the next forward (train.optimizer_overlap=auto)
                   ("optimizer_overlap", "off", "eda0b33", "2026-12-06T13:59"))
# what changed in moelab's code, with no config field to say it, that the planner can still plan the old way
# (moelab.planner.plan.plan's keywords): records older than the commit's date are planned with the option's value
# before it (the planner option, its value before, the commit, its date); ``planner_options`` reads it
LEAN_FSDP = ("6131a2c", "2026-12-01T11:45:53Z")  # lean FSDP: one-rank meshes left plain, explicit prefetch under EP
# the local dispatcher applied the routing weights at combine and kept the expert outputs (moelab.planner.saved)
LOCAL_WEIGHTING = ("a3f8c38", "2026-12-02T05:04")
SONIC_WGRAD = ("af73383", "2026-12-06T03:11:55Z")  # SonicMoE's weight-gradient GEMMs add into .grad
SONIC_TILES = ("756805e", "2026-12-06T07:51:21Z")  # SonicMoE's GEMMs with moelab's tiles, not QuACK's default config
GRAD_NORM = ("3187545", "2026-12-06T08:02:32Z")  # the gradient norm in one Triton pass per gradient
INTO_GRAD = ("cba26db", "2026-12-06T10:57:20Z")  # the embedding's and the full loss head's backward add into .grad
EXPERT_NORM = ("d255f7c", "2026-12-06T17:48:10Z")  # the experts' gradient squares summed by their GEMMs
FULL_LOSS = ("56f5afa", "2026-12-06T20:49:28Z")  # backend.loss=full's in-place kernel (moelab.backends.loss_kernel)
CLIP_IN_UPDATE = ("fb2903b", "2026-12-07T15:20:58Z")  # clipping's multiply in TritonAdamW's update (clip_in_step)
CODE_BEFORE = (("fsdp_one_rank", "wrapped", *LEAN_FSDP),  # FSDP2 wrapped units on one-rank meshes too
               ("local_weighting", "combine", *LOCAL_WEIGHTING),
               ("sonic_wgrad", "autograd", *SONIC_WGRAD),
               ("sonic_tiles", "quack", *SONIC_TILES),
               ("grad_norm", "torch", *GRAD_NORM),
               ("into_grad", "autograd", *INTO_GRAD),
               ("expert_norm", "pass", *EXPERT_NORM),
               ("full_loss", "compiled", *FULL_LOSS),
               ("clip_multiply", "pass", *CLIP_IN_UPDATE))
# the record's optimizer class or config value -> train.optimizer (moelab.train.optim builds the class from it)
_OPTIMIZERS = {"tritonadamw": "adamw_triton", "adamw_triton": "adamw_triton", "adamw": "adamw"}
# recorded `--set` / overrides that change the model, the layout or the step (data and bookkeeping do not)
_SECTIONS = ("model.", "parallel.", "train.", "backend.")
_BOOKKEEPING = ("train.device", "train.steps", "train.warmup_steps", "train.lr", "train.save_checkpoints",
                "train.checkpoint_every")


def record_settings(r: dict) -> dict:
    """The loss, FP8 recipe and optimizer kernel a record ran, as config values: its own fields ("chunked (the
    default at 5ad9062)" -> chunked, "TritonAdamW" -> adamw_triton), or for a dated record older than a field,
    the code's behaviour then (DEFAULTS_BEFORE); absent where neither tells.

        record_settings({"loss": "chunked", "optimizer": "TritonAdamW"})   # {'loss': 'chunked', 'optimizer': 'adamw_triton'}
    """
    out = {}
    loss = str(r.get("loss") or (r.get("backends") or {}).get("loss") or "").split(" ")[0]
    opt = str(r.get("optimizer") or "").replace("auto: ", "").split(" ")[0].lower()
    if loss:
        out["loss"] = loss
    if opt:
        out["optimizer"] = _OPTIMIZERS.get(opt, opt)
    elif "triton-adamw" in r.get("_file", ""):  # a variant that ran TritonAdamW by the benchmark script's flag
        out["optimizer"] = "adamw_triton"
    if r.get("optimizer_overlap") is not None:  # gpu_perf's records say whether the overlap ran
        out["optimizer_overlap"] = "auto" if r["optimizer_overlap"] else "off"
    date = str(r.get("date") or "")
    for key, value, _, since in DEFAULTS_BEFORE:
        if date and date < since:
            out.setdefault(key, value)
    if r.get("fp8") is not None:
        out["fp8"] = {False: "off", True: "rowwise"}.get(r["fp8"], r["fp8"])
    return out


def planner_options(r: dict) -> dict:
    """The planner options (moelab.planner.plan.plan's keywords) that plan a record as the code of its day ran:
    for a dated record older than a change in CODE_BEFORE, the option's value before it; {} for today's code
    (and for an undated record, as record_settings does).

        planner_options({"date": "2026-11-30T12:53:02Z"})   # {'fsdp_one_rank': 'wrapped'}
    """
    date = str(r.get("date") or "")
    out = {key: value for key, value, _, since in CODE_BEFORE if date and date < since}
    if r.get("norm_in_gemms") is False:  # timed with the norm's own pass (gpu_perf's bf16-norm-pass)
        out["expert_norm"] = "pass"
    if r.get("grad_clip") and r.get("clip_in_update") is False:  # clipping's own pass (gpu_perf's bf16-clip-pass)
        out["clip_multiply"] = "pass"
    if r.get("loss_in_place") is False:  # timed with the compiled full loss (gpu_perf's bf16-loss-compiled)
        out["full_loss"] = "compiled"
    return out


def rebuild_config(r: dict, entries: dict) -> tuple[Config | None, str]:
    """The config a result ran, as faithfully as the record says it, or (None, why it cannot be rebuilt).

    From its gallery entry (or its preset, when the record carries batch, dtypes and layout), then the record's
    own overrides (`overrides` list, `--set` of its command), then every setting it records: batch, sequence,
    dtypes, checkpointing, compile, router (its kind, or the fake gate's fields), optimizer state, FP8, the loss
    and its chunk, the backends, the optimizer, the layout. A record without a `loss` (and no `backends.loss`) predates backend.loss: it ran the
    full loss, the only one there was (`moelab bench` records the loss since it exists).

        cfg, why = rebuild_config(record, {e.name: e for e in load_entries()})
    """
    from moelab.presets import preset_names

    preset = r.get("preset", r.get("workload"))
    try:
        if r.get("workload") in entries:
            cfg = entries[r["workload"]].config()
        elif preset in preset_names():
            missing = [k for k in REBUILD_KEYS if k not in r and not (k == "layout" and r.get("gpus") == 1)]
            if missing:  # one GPU: the layout is one GPU
                return None, (f"the record lacks {', '.join(missing)} (a script's variant, which may change the "
                              "model in place)")
            cfg = load_config(preset)
        else:
            return None, f"it names neither a gallery entry nor a preset ({r.get('workload')})"
        recorded = {k: v for k, v in recorded_overrides(r).items()
                    if k.startswith(_SECTIONS) and k not in _BOOKKEEPING}
        if recorded:
            cfg = load_config(cfg, recorded)
        over = {key: r[k] for k, key in _RESULT_OVERRIDES.items() if r.get(k) is not None}
        over.setdefault("train.optimizer_state", "auto")  # records before the field: moments in param_dtype
        if r.get("router"):  # the router kind the record states (router_of's spellings)
            kind = router_of(r).kind
            over["backend.fake_balanced_gate"] = kind != "learned"
            over["backend.fake_gate_noise"] = float(kind.split("=")[1]) if kind.startswith("fake_noise=") else 0.0
        backends = r.get("backends") or {}
        over.update({f"backend.{k}": backends[k] for k in ("attention", "experts", "dispatcher") if backends.get(k)})
        if r.get("experts") not in (None, "auto") and not backends.get("experts"):  # the experts it ran (gpu_perf's
            over["backend.experts"] = r["experts"]  # records: auto's choice resolved, e.g. SonicMoE where installed)
        ran = record_settings(r)
        over["backend.loss"] = ran.get("loss", "full")  # no loss recorded: it predates backend.loss (the full loss)
        over.update({f"train.{k}": ran[k] for k in ("optimizer", "fp8", "optimizer_overlap") if k in ran})
        over.update({f"parallel.{k}": v for k, v in (r.get("layout") or {}).items()})
        return cfg.replace(**over), ""
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        return None, f"its recorded settings do not make a valid config ({str(e)[:160]})"


def gpu_memory_of(gpu_name: str) -> float | None:
    """Memory of a GPU named in a result, for the planner's verdict (None: the planner's default)."""
    name = (gpu_name or "").upper()
    for key, gb in (("H200", 140.0), ("H100", 79.2), ("A100", 79.2), ("B200", 178.4)):
        if key in name:
            return gb
    return None


# ---------------------------------------------------------------------- rendering helpers
def commit_of(r: dict) -> str:
    """A record's commit, short (without "-dirty")."""
    return str(r.get("commit") or "?").removesuffix("-dirty")[:7]


def fmt(v, digits: int = 0) -> str:
    """A figure with thousands separators, '-' for None."""
    return "-" if v is None else f"{v:,.{digits}f}"


def by_router(r: dict, entries: "dict | None" = None) -> dict:
    """A record's throughput figures by router kind: its headline, and what was timed beside it on the same model
    (`fake_router` from moelab bench; `real_router`, the learned router, in records before the headline was the
    learned one)."""
    out = {router_of(r, entries).kind: r}
    if isinstance(r.get("fake_router"), dict):
        out[r["fake_router"]["router"]] = r["fake_router"]
    if isinstance(r.get("real_router"), dict):
        out["learned"] = r["real_router"]
    return out


def stale_note(r: dict, cfg, entries: "dict | None" = None) -> str:
    """What differs between the settings a record ran and an entry's config now (compile, parameter dtype,
    router kind of the figure shown); "" when nothing that this checks does."""
    now = {"compile": cfg.train.compile, "param_dtype": cfg.train.param_dtype, "router": cfg.backend.router_kind}
    then = {"compile": r.get("compile"), "param_dtype": r.get("param_dtype"), "router": router_of(r, entries).kind}
    diff = [k for k in now if then[k] is not None and then[k] != "unknown" and then[k] != now[k]]
    if not diff:
        return ""
    return ("; recorded with " + ", ".join(f"{k}={then[k]}" for k in diff) + ", the entry now asks "
            + ", ".join(f"{k}={now[k]}" for k in diff) + ": re-run to replace it")


def router_sweep_section(results: list) -> list[str]:
    """Markdown: the newest router sweep (router_sweep.py) of each workload and global batch: throughput with
    the learned router and with fake_gate_noise 0, 0.1, 0.5, 1.0, each against the learned one."""
    lines = ["## What imbalance costs: learned router against fake_gate_noise", "",
             "One model, one process (gallery/scripts/router_sweep.py; `PARTS=router-sweep bash "
             "gallery/scripts/gpu_run.sh`): the learned router, then the fake balanced gate (round-robin, noise 0) "
             "and with backend.fake_gate_noise shifting it; load max/mean is the busiest expert over the mean "
             "load, averaged over the MoE layers of one step after the timed ones.", ""]
    sweeps: dict = {}
    for r in results:
        if r.get("sweep") == SWEEP and r.get("tokens_per_s_per_gpu") and "error" not in r:
            sweeps.setdefault((r["workload"], r.get("global_batch_size")), {}).setdefault(
                (commit_of(r), str(r.get("sweep_id", ""))), []).append(r)
    if not sweeps:
        return lines + ["No router sweep records yet.", ""]
    for (w, gbs), runs in sorted(sweeps.items(), key=lambda x: str(x[0])):
        rows = max(runs.values(), key=lambda rs: max(str(r.get("date", "")) for r in rs))
        learned = next((r for r in rows if r.get("router") == "learned"), None)
        lines += [f"### {w}, global batch {gbs}, {rows[0].get('gpus')} x {rows[0].get('gpu_name')}, commit "
                  f"{commit_of(rows[0])}", "",
                  "| router | tokens/s/GPU | vs learned | TFLOPs/GPU | step ms | load max/mean | peak GiB | record |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in sorted(rows, key=lambda r: (r.get("router") != "learned", float(r.get("fake_gate_noise") or 0),
                                             r.get("router") != "fake_balanced")):
            vs = f"{r['tokens_per_s_per_gpu'] / learned['tokens_per_s_per_gpu']:.3f}" if learned else "-"
            lines.append(f"| {r.get('router')} | {fmt(r['tokens_per_s_per_gpu'])} | {vs} | "
                         f"{fmt(r.get('tflops_per_gpu'), 1)} | {fmt(r.get('step_time_ms'), 1)} | "
                         f"{fmt(r.get('load_max_over_mean'), 2)} | {fmt(r.get('peak_memory_gb'), 1)} | "
                         f"{r.get('_file', '-')} |")
        lines.append("")
    return lines
