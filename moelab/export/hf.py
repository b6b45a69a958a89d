"""A trained run in transformers' layout: ``moelab export RUN --to hf OUT`` and ``run.export_hf(out)``.

The newest intact checkpoint of the run (moelab.contract.checkpoints: a torch.distributed.checkpoint folder whose
tensors are global, experts included: moelab.train.checkpoint_experts) is read in this one process, on the CPU,
without a process group, whatever layout wrote it (FSDP2, EP, PP, CP); the model tensors only, never the
optimizer state. They are written with moelab.hf.save_hf (the per-family adapters): config.json plus
model.safetensors, or shards with model.safetensors.index.json past `max_shard_size`; the tokenizer files are
copied where the run has them.

    export_hf("runs/tiny", "out/tiny-hf")                                  # float32, as trained
    export_hf("runs/big", "out/big-hf", dtype="bfloat16", max_shard_size="2GB")
    AutoModelForCausalLM.from_pretrained("out/tiny-hf")                    # moelab's logits

A run started from an HF checkpoint keeps that checkpoint's config.json fields (its base folder: `base=`, or
the config field that records it, BASE_FIELDS); other runs get the family moelab.hf.family_of picks.

LoRA (`lora`): "merged" folds the adapters into the base weights before writing them
(moelab.model.lora.merge_lora_state); "adapters" writes the adapters alone in PEFT's layout,
adapter_config.json + adapter_model.safetensors (moelab.hf.peft.write_peft_adapters). None: merged when the run
has adapters. A checkpoint that holds only what trained (LoRA's adapters) takes the rest from its base folder.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from moelab.config import Config, ConfigError, load_config
from moelab.config.paths import check_path
from moelab.contract.writes import CAUSES, FolderWriteError, folder_cause
from moelab.hf import adapter_for, config_to_hf, family_of, save_hf
from moelab.hf.safetensors_folder import SafetensorsFolder, quantization
from moelab.hf.shards import INDEX, parse_size
from moelab.model.assemble import assemble
from moelab.model.transformer import MoETransformer
from moelab.contract.folder import CONFIG, RunFolder
from moelab.contract.checkpoints import latest_checkpoint, list_checkpoints, read_metadata, verify

LORA_MODES = ("merged", "adapters")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Where a run started from an HF checkpoint records its folder ("hf:PATH"; the start from a checkpoint sets it).
BASE_FIELDS = ("train.init_from",)
# What transformers' tokenizers (and generate) read from a model folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
# the other names an export writes (save_hf: moelab.hf.shards; write_peft_adapters)
EXPORT_NAMES = re.compile(r"config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|"
                          + re.escape(INDEX) + r"|adapter_config\.json|adapter_model\.safetensors")


# ---------------------------------------------------------------------- checks (before any weight is read)
def _dtype(dtype) -> "torch.dtype | None":
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ConfigError(f"dtype={dtype!r}: export writes {' or '.join(DTYPES)} (None keeps the checkpoint's dtype)")


def _out_folder(out: "str | Path", force: bool) -> Path:
    out = check_path("out", out, "folder to write", "give a folder to write the checkpoint into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"out={str(out)!r}: the folder is not empty; give an empty or new folder, or "
                          f"force=True (--force) to write over an earlier export there (other files stay)")
    return out


def export_files(out: Path) -> list[Path]:
    """The files in `out` that an export writes (EXPORT_NAMES, the tokenizer files): the only ones --force
    replaces and a failed export removes; a person's other files there (notes, their own *.safetensors) stay."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.is_file() and (p.name in TOKENIZER_FILES or EXPORT_NAMES.fullmatch(p.name)))


def _clear(out: Path) -> None:
    """Before writing over an earlier export: its files would linger beside the new ones (shards, an index)."""
    for stale in export_files(out):
        stale.unlink(missing_ok=True)


@contextlib.contextmanager
def _writing_export(out: Path):
    """The export's writes: when one fails, what it wrote is removed (the folder too when it made it) and a disk
    that is full or cannot be written is one FolderWriteError line."""
    made = not out.exists()
    try:
        yield
    except BaseException as e:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        else:  # the earlier export's files were cleared before writing: every export file there is this one's
            _clear(out)
        cause = _disk_cause(e)
        if cause is None:
            raise
        raise FolderWriteError(cause, out, None, left="the partial export was removed",
                               then="export again") from None


def _disk_cause(e: BaseException) -> "int | None":
    """The errno of a full or read-only disk behind `e`: an OSError in its chain, or safetensors' error, which
    carries only the text of Rust's io::Error ("No space left on device (os error 28)")."""
    found = folder_cause(e) if isinstance(e, Exception) else None
    if found is not None:
        return found.errno
    text = str(e)
    return next((n for n in CAUSES if f"(os error {n})" in text or os.strerror(n) in text), None)


def checkpoint_of(run_dir: Path) -> Path:
    """The run's newest intact checkpoint; a ConfigError saying how to get one when there is none."""
    path = latest_checkpoint(run_dir)
    if path is not None:
        return path
    found = list_checkpoints(run_dir)
    if found:
        problems = "; ".join(verify(found[-1]))
        raise ConfigError(f"{run_dir}: no intact checkpoint to export ({len(found)} found, none complete: "
                          f"{problems}); resume the run (moelab resume {run_dir}) to write one")
    raise ConfigError(f"{run_dir}: the run has no checkpoint to export; train with train.save_checkpoints=true "
                      f"(a checkpoint at the end) and train.checkpoint_every=N for checkpoints on the way")


def _changed(saved: dict, now: dict, prefix: str) -> list[str]:
    """The model fields whose value differs from the checkpoint's record ("field: saved -> now"); a field the
    record lacks (added to moelab since, at its default) is no difference."""
    out = []
    for k, v in saved.items():
        if isinstance(v, dict) and isinstance(now.get(k), dict):
            out += _changed(v, now[k], f"{prefix}{k}.")
        elif k in now and now[k] != v:
            out.append(f"{prefix}{k}: {v!r} -> {now[k]!r}")
    return out


def base_of(cfg: Config, base: "str | Path | None" = None) -> Path | None:
    """The HF checkpoint folder the run started from: `base`, else the first BASE_FIELDS value set."""
    if base is None:
        for dotted in BASE_FIELDS:
            node = cfg
            for part in dotted.split("."):
                node = getattr(node, part, None)
            if isinstance(node, str) and node:
                base = node
                break
    if base is None:
        return None
    path = Path(str(base).removeprefix("hf:"))
    if not (path / "config.json").is_file():
        raise ConfigError(f"base={str(base)!r}: no config.json there; give the HF checkpoint folder the run "
                          f"started from (or none)")
    return path


def has_lora(cfg: Config, names) -> bool:
    """The run trained LoRA adapters: train.lora is on, or the checkpoint holds adapter tensors."""
    lora = getattr(cfg.train, "lora", None)
    on = bool(getattr(lora, "rank", lora)) if lora is not None else False
    return on or any("lora" in n.lower() for n in names)


# ---------------------------------------------------------------------- reading the checkpoint
def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint folder (full, global shapes; moelab names), read in this process
    without a process group: one tensor per name as the metadata describes it, filled by dcp.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    if not state:
        raise ConfigError(f"{path}: the checkpoint holds no model tensors")
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    return state


def model_from_state(cfg: Config, state: dict[str, torch.Tensor], where: Path) -> MoETransformer:
    """A CPU model holding `state` (its tensors, not copies); a ConfigError naming what does not fit."""
    if cfg.model.tie_embeddings:
        state.setdefault("output.weight", state.get("tok_embeddings.weight"))

    def load(model: MoETransformer) -> None:  # the statistics buffers (not in checkpoints) start at zero
        want = model.state_dict()
        missing = sorted(set(want) - set(state))
        unknown = sorted(set(state) - set(want))
        wrong = sorted(k for k in set(want) & set(state) if want[k].shape != state[k].shape)
        if missing or unknown or wrong:
            raise ConfigError(f"{where}: the checkpoint does not fit the run's config ({len(missing)} tensors "
                              f"missing, e.g. {missing[:3]}; {len(unknown)} unknown, e.g. {unknown[:3]}; "
                              f"{len(wrong)} of another shape, e.g. {wrong[:3]}); is config.yaml the one these "
                              f"checkpoints were written with?")
        model.load_state_dict(state, strict=True, assign=True)

    return assemble(cfg, "load", "cpu", load=load).eval()


def fill_base(state: dict[str, torch.Tensor], cfg: Config, base: Path | None, pointer: dict) -> None:
    """The frozen base weights a LoRA checkpoint does not hold (it saves only what trains, and the routers'
    buffers, with a pointer to its base in metadata.json): read from the HF folder it started from, or made again
    from the seed as the run's setup made them (the adapters added first, as the trainer does)."""
    if base is not None:
        hf = json.loads((base / "config.json").read_text())
        tensors = SafetensorsFolder(base, quantization(hf))
        full = adapter_for(hf).state_dict_from_hf(hf, cfg.model, tensors)
    elif "seed" in pointer:
        full = assemble(cfg.replace(**{"train.seed": pointer["seed"]}), "lora").state_dict()
    else:
        return
    for name, t in full.items():
        state.setdefault(name, t)


# ---------------------------------------------------------------------- tokenizer files
def copy_tokenizer(run_dir: Path, cfg: Config, base: Path | None, out: Path) -> list[str]:
    """The transformers tokenizer files of the run, copied into `out`: those of the base folder, else of the
    data.tokenizer folder, else the run's tokenizer.json (moelab's bpe or a tokenizer.json path) with a
    tokenizer_config.json naming PreTrainedTokenizerFast. The bytes tokenizer has no files: nothing is copied."""
    tok = Path(cfg.data.tokenizer) if cfg.data.tokenizer not in ("bytes", "bpe") else None
    for folder in (base, tok if tok is not None and tok.is_dir() else None):
        if folder is not None and any((folder / f).is_file() for f in TOKENIZER_FILES[:2]):
            names = [f for f in TOKENIZER_FILES if (folder / f).is_file()]
            for f in names:
                shutil.copyfile(folder / f, out / f)
            return names
    if RunFolder(run_dir).tokenizer.is_file():
        shutil.copyfile(RunFolder(run_dir).tokenizer, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        return ["tokenizer.json", "tokenizer_config.json"]
    return []


def _state_and_model(cfg: Config, path: Path, lora: str | None, base: "Path | None", hf_base: "dict | None"):
    """The checkpoint's model state (LoRA's frozen base filled in) and the model built from it with any LoRA
    adapters merged, or None for the model when only the adapters are exported (lora="adapters")."""
    state = read_model_state(path)
    lora_on = has_lora(cfg, state)
    if lora is not None and not lora_on:
        raise ConfigError(f"lora={lora!r}: the run has no LoRA adapters (train.lora is off and {path} holds no "
                          f"adapter tensors); export without lora")
    if lora_on:
        fill_base(state, cfg, base, read_metadata(path).get("base") or {})
    model = None
    if not (lora_on and lora == "adapters"):
        if lora_on:
            from moelab.model.lora import merge_lora_state

            state = merge_lora_state(state, cfg)
        model = model_from_state(cfg, state, path)
        model.hf_config = hf_base
    return state, model


# ---------------------------------------------------------------------- the export
def export_hf(run_dir: "str | Path", out: "str | Path", dtype=None, max_shard_size: "int | str" = "5GB",
              lora: str | None = None, force: bool = False, base: "str | Path | None" = None) -> Path:
    """Write the run's newest intact checkpoint to `out` in transformers' layout; returns `out`.

    dtype: "float32" or "bfloat16" (None: as the checkpoint holds them); max_shard_size: shards past it, with
    an index ("5GB" as transformers' default); lora: "merged" or "adapters" (module docstring); force: write
    into a folder that is not empty; base: the HF folder the run started from (default: what its config records).
    """
    run_dir = Path(run_dir)
    if not RunFolder(run_dir).config.is_file():
        raise FileNotFoundError(f"{run_dir}: not a run folder (no {CONFIG})")
    if lora is not None and lora not in LORA_MODES:
        raise ConfigError(f"lora={lora!r}: choose 'merged' (adapters folded into the weights) or 'adapters' "
                          f"(PEFT's layout), or leave it unset")
    torch_dtype = _dtype(dtype)
    parse_size(max_shard_size)
    cfg = load_config(RunFolder(run_dir).config)
    base = base_of(cfg, base)
    hf_base = json.loads((base / "config.json").read_text()) if base is not None else None
    family = adapter_for(hf_base).model_type if hf_base else family_of(cfg.model)
    config_to_hf(cfg.model, family, hf_base)  # a config the family cannot express is refused here
    path = checkpoint_of(run_dir)
    changed = _changed(read_metadata(path).get("config", {}).get("model", {}), cfg.to_dict()["model"], "model.")
    if changed:
        raise ConfigError(f"{run_dir}/config.yaml is not the config {path} was written with ({'; '.join(changed[:4])})"
                          f"; restore the run's own config.yaml")
    out = _out_folder(out, force)

    state, model = _state_and_model(cfg, path, lora, base, hf_base)
    with _writing_export(out):
        out.mkdir(parents=True, exist_ok=True)
        _clear(out)
        if model is None:
            from moelab.hf.peft import write_peft_adapters

            write_peft_adapters(state, cfg, out, base_model_name_or_path=str(base) if base else None, hf=hf_base)
        else:
            try:
                save_hf(model, out, dtype=torch_dtype, max_shard_size=max_shard_size)
            except ConfigError as e:
                raise ConfigError(f"{run_dir} cannot be exported to transformers' layout: {e}") from None
        copy_tokenizer(run_dir, cfg, base, out)
    return out
