"""Start a run from a Hugging Face checkpoint: every rank copies into its parameters only the slices it owns.

    check_init(cfg)                      # before any rank starts: folder, config.json, every tensor's shape
    stats = load_into(par.model, cfg)    # on each rank, after parallelize: {"bytes_read_per_rank": ..., ...}

The model is placed first (moelab.parallel: EP keeps this rank's experts, PP this stage's layers, FSDP2 shards
dim 0 of each parameter over its mesh); then each local tensor is filled from the checkpoint's rows
[start, start + local rows) of its dim 0, where start is the FSDP2 shard's global offset plus, for stacked
experts, the first expert this EP rank owns (`expert_offset`). The adapters (moelab.hf.adapter `sources`) map
those rows to the file's rows: a slice of one HF tensor, the experts [a, b) of a stacked layer (one file tensor
per expert, or a fused one), DeepSeek's permuted rotary rows (the smallest covering range), FP8 scale rows and
MXFP4 experts dequantized as read. So a rank reads about 1/world of the checkpoint, never the whole model
(SafetensorsFolder.bytes_read counts it; tests/hf/test_start_from_hf.py checks it on EP=2 and PP=2).

Transient host memory: one tensor slice at a time, in the file's dtype plus fp32 (dequantized) and the stacked
copy, about 12 bytes per element of the largest local slice (the planner's `loading` figure).
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moelab.config import Config, ConfigError
from moelab.hf import adapter_for
from moelab.hf.safetensors_folder import SafetensorsFolder, ignorable, quantization
from moelab.hf.source import checkpoint_folder, read_hf_config
from moelab.parallel.place import shard_offsets

FIELD = "train.init_from"


def open_checkpoint(cfg: Config) -> tuple[Path, dict, SafetensorsFolder]:
    """(folder, moelab name -> Rows, the SafetensorsFolder) of cfg.train.init_from; ConfigError naming the
    field for a folder without config.json or weights, or a tensor the checkpoint lacks."""
    spec = cfg.train.init_from
    path = checkpoint_folder(spec, FIELD)
    hf = read_hf_config(path, FIELD)
    try:
        adapter = adapter_for(hf)
        folder = SafetensorsFolder(path, quantization(hf))
        return path, adapter.sources(hf, cfg.model, folder), folder
    except ConfigError as e:
        raise ConfigError(f"{FIELD}={spec!r}: {e}; the model fields must be those of its config.json (an "
                          f"override of model.* that changes the layers does not fit these weights)") from None


def check_init(cfg: Config) -> None:
    """Refuse, before any rank starts, a checkpoint whose tensors do not fit the model `cfg` builds: missing
    tensors, tensors of another shape (each named, with both shapes), and checkpoint tensors with no place in the
    model. Reads only the files' headers. Does nothing when cfg.train.init_from is empty."""
    if not cfg.train.init_from:
        return
    from moelab.model.assemble import assemble

    path, sources, folder = open_checkpoint(cfg)
    model = assemble(cfg, "shapes")
    spec = cfg.train.init_from
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(sources))
    if missing:
        raise ConfigError(f"{FIELD}={spec!r}: the checkpoint has no tensor for {len(missing)} parameters, e.g. "
                          f"{missing[:3]}; is config.json the one of these weights?")
    wanted = {**dict(model.named_buffers()), **params}
    wrong = [f"{name}: checkpoint {list(sources[name].shape)}, model {list(t.shape)}"
             for name, t in wanted.items() if name in sources and sources[name].shape != tuple(t.shape)]
    if wrong:
        raise ConfigError(f"{FIELD}={spec!r}: {len(wrong)} tensors do not match the model's shapes: "
                          f"{'; '.join(wrong[:4])}; use the config.json of these weights (and no model.* "
                          f"override that changes shapes)")
    unused = [k for k in folder.names() if k not in folder.used and not ignorable(k, cfg.model.num_layers, folder)]
    if unused:
        raise ConfigError(f"{FIELD}={spec!r}: {len(unused)} checkpoint tensors have no place in the model, e.g. "
                          f"{unused[:3]}; is config.json the one of these weights?")


def owned_slices(model: nn.Module):
    """(single-process name, this rank's local tensor, its first row in the full tensor, the slices of its other
    dimensions: TP's column shards) for every parameter and buffer of a placed model (each once; tied ones too)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        expert_offset = getattr(mod, "expert_offset", 0)  # moelab.parallel.expert_parallel.shard_experts
        for name, t in itertools.chain(mod.named_parameters(recurse=False), mod.named_buffers(recurse=False)):
            if id(t) in seen:
                continue
            seen.add(id(t))
            full = f"{mod_name}.{name}" if mod_name else name
            offsets = (0,) * t.dim()
            if isinstance(t, DTensor):
                offsets, t = shard_offsets(t), t.to_local()
            is_param = isinstance(mod._parameters.get(name), nn.Parameter)
            columns = tuple(slice(o, o + n) for o, n in zip(offsets[1:], t.shape[1:]))
            yield full, t, (offsets[0] if offsets else 0) + (expert_offset if is_param else 0), columns


@torch.no_grad()
def load_into(model: nn.Module, cfg: Config, progress: bool = False) -> dict:
    """Fill this rank's parameters (and the routing buffers the checkpoint holds) of a placed model from
    cfg.train.init_from, reading only their rows; a tqdm bar of the bytes when `progress` (rank 0). Returns
    {"path", "bytes_read", "bytes_read_per_rank", "tensors", "checkpoint_bytes"}: what this rank (and every
    rank: a collective when torch.distributed is initialised) read, and the whole checkpoint's tensor bytes."""
    path, sources, folder = open_checkpoint(cfg)
    targets = [(n, t, s, c) for n, t, s, c in owned_slices(model) if n in sources]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(t.numel() * t.element_size() for _, t, _, _ in targets), unit="B", unit_scale=True,
                   desc=f"loading {path.name}")
    for name, local, start, columns in targets:
        src = sources[name]
        value = src.read(start, start + local.shape[0])[(slice(None), *columns)] if local.dim() else src.read()
        if tuple(value.shape) != tuple(local.shape):
            raise ConfigError(f"{FIELD}={cfg.train.init_from!r}: {name} rows {start}..{start + len(local)} have "
                              f"shape {list(value.shape)}, this rank holds {list(local.shape)}")
        local.copy_(value)
        if bar is not None:
            bar.update(local.numel() * local.element_size())
    if bar is not None:
        bar.close()
    per_rank = [folder.bytes_read]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # every rank loads
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, folder.bytes_read)
    return {"path": str(path), "bytes_read": folder.bytes_read, "bytes_read_per_rank": per_rank,
            "tensors": len(targets), "checkpoint_bytes": checkpoint_bytes(folder)}


def checkpoint_bytes(folder: SafetensorsFolder) -> int:
    """Bytes of tensor data in the checkpoint's files (from the headers)."""
    total = 0
    for name in folder.names():
        sl = folder._slice(name)
        total += math.prod(sl.get_shape()) * _itemsize(sl.get_dtype())
    return total


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
            "U16": 2}.get(dtype, 1)
