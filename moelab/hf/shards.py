"""Writing safetensors the way transformers' save_pretrained does: one model.safetensors, or, past
`max_shard_size`, shards model-00001-of-0000N.safetensors with model.safetensors.index.json mapping every tensor
to its file (the index transformers, vLLM and moelab's SafetensorsFolder read).

    write_safetensors({"lm_head.weight": w}, Path("out"), max_shard_size="5GB")   # ["model.safetensors"]
    parse_size("500MB"), parse_size("2GiB"), parse_size(10_000)                   # bytes
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from moelab.config import ConfigError

INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(size: "int | str", field: str = "max_shard_size") -> int:
    """Bytes of a size as transformers writes it ("5GB" = 5e9 bytes, "5GiB" = 5 * 2**30, or an int)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"{field}={size!r}: give a positive size such as '5GB', '500MB', '2GiB' or a byte count")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def shard_plan(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most `max_bytes` each, in the given order (a tensor larger than
    the limit gets a shard of its own, as transformers does)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_size: "int | str" = "5GB") -> list[str]:
    """Write `tensors` into `out` as one file or as shards with an index; returns the file names written."""
    from safetensors.torch import save_file

    shards = shard_plan(tensors, parse_size(max_shard_size))
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, keys in zip(names, shards):
        save_file({k: tensors[k].contiguous().cpu() for k in keys}, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    if len(names) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                            indent=2, sort_keys=True))
    return names
