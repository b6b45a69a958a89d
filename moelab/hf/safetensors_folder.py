"""Reading HF checkpoint folders: safetensors files or shards, block-FP8 and MXFP4 weights dequantized on read.

    tensors = SafetensorsFolder(Path("Qwen3-30B-A3B"), quantization(json.load(open(".../config.json"))))
    w = tensors.get("model.embed_tokens.weight")      # fp32
    rows = tensors.rows("lm_head.weight"); rows.shape; rows.read(0, 128)   # only rows 0..127 are read

`Rows` is a tensor not yet read: its shape (from the file headers) and a reader of row ranges of dim 0, so a
rank reads only the slice it owns (moelab.hf.sharded_load); `bytes_read` counts what was read from the files.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch

from moelab.config import ConfigError


def quantization(hf: dict) -> dict | None:
    """The checkpoint's quantization if moelab can dequantize it: block FP8 (the published DeepSeek-V3 / Kimi-K2
    weights) or MXFP4 experts (the published GPT-OSS weights); None for bf16/fp32."""
    q = hf.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") == "fp8" and q.get("weight_block_size"):
        return {"method": "fp8", "block": tuple(q["weight_block_size"])}
    if q.get("quant_method") == "mxfp4":
        return {"method": "mxfp4"}
    raise ConfigError(f"config.json quantization_config quant_method={q.get('quant_method')!r}: moelab reads "
                      f"bf16/fp32 checkpoints, block FP8 ('fp8' with weight_block_size) and MXFP4 ('mxfp4'); "
                      f"dequantize the weights first")


# MXFP4 (OCP microscaling): 4-bit e2m1 values, two per byte (low nibble first), one e8m0 scale per 32 values.
_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks_ERGB: torch.Tensor, scales_ERG: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's packed experts -> fp32 [E, C, R]: blocks [E, R, G, B] (uint8, 2B values each) and scales
    [E, R, G] (uint8 exponents biased by 127) hold an [E, R, C=G*2B] matrix that HF stores transposed."""
    lut = torch.tensor(_FP4_E2M1, dtype=torch.float32, device=blocks_ERGB.device)
    b = blocks_ERGB.to(torch.uint8).long()
    vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [E, R, G, 2B]
    vals = torch.ldexp(vals, (scales_ERG.to(torch.int32) - 127)[..., None].float())
    return vals.flatten(-2).transpose(1, 2).contiguous()


class Rows:
    """A tensor of known shape, read on demand by row ranges of dim 0 (0-dim tensors: read whole).

        r = Rows((8, 4), lambda a, b: torch.zeros(b - a, 4)); r.read(2, 4).shape   # (2, 4)
        r.map(lambda t: t.t(), (4, 8))            # a derived tensor: rows of the result = rows of r
    """

    def __init__(self, shape, read: Callable[[int, int], torch.Tensor]):
        self.shape, self._read = tuple(int(n) for n in shape), read

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if not self.shape:
            return self._read(0, 0)
        return self._read(start, self.shape[0] if stop is None else stop)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], shape=None) -> "Rows":
        """Rows whose row i is fn applied to rows of this one (fn keeps dim 0: a transpose of the other dims,
        a column permutation); `shape` is the result's (default: this one's)."""
        return Rows(self.shape if shape is None else shape, lambda a, b: fn(self._read(a, b)))

    def permuted(self, order: torch.Tensor) -> "Rows":
        """Row i of the result is row order[i] of this one; reads the smallest row range covering the rows."""
        def read(a: int, b: int) -> torch.Tensor:
            idx = order[a:b]
            if not len(idx):
                return self._read(0, 0)
            lo, hi = int(idx.min()), int(idx.max()) + 1
            return self._read(lo, hi)[idx - lo]
        return Rows(self.shape, read)


class SafetensorsFolder:
    """Lazy access to the tensors of a checkpoint folder (one file, or shards with an index json); FP8 weights
    with a `<name>_scale_inv` block scale are dequantized to fp32 as they are read.

        folder = SafetensorsFolder(path); "lm_head.weight" in folder; folder.get("lm_head.weight")
        folder.rows("lm_head.weight").read(0, 16); folder.bytes_read     # a slice, and the bytes it cost
    """

    def __init__(self, path: Path, quantization: dict | None = None):
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            weight_map = {}
            for f in sorted(path.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as st:
                    weight_map.update({k: f.name for k in st.keys()})
        if not weight_map:
            raise ConfigError(f"{path}: no *.safetensors files (the checkpoint's weights); give the folder "
                              f"that holds model.safetensors or its shards")
        self.path, self.weight_map, self.used, self.quantization = path, weight_map, set(), quantization
        self.bytes_read = 0  # bytes of tensor data read from the files (what a rank's share of a load costs)
        self._handles: dict = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map or (self._method() == "mxfp4" and name + "_blocks" in self.weight_map)

    def _method(self) -> str | None:
        return self.quantization["method"] if self.quantization else None

    def _slice(self, name: str):
        from safetensors import safe_open

        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file].get_slice(name)

    def _read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        self.used.add(name)
        sl = self._slice(name)
        t = sl[start:stop] if sl.get_shape() else self._handles[self.weight_map[name]].get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape `get(name)` returns, from the file headers (nothing is read)."""
        if self._method() == "mxfp4" and name not in self.weight_map and name + "_blocks" in self.weight_map:
            E, R, G, B = self._slice(name + "_blocks").get_shape()
            return (E, G * 2 * B, R)
        if name not in self.weight_map:
            raise ConfigError(f"{self.path}: checkpoint tensor {name!r} is missing")
        return tuple(self._slice(name).get_shape())

    def rows(self, name: str) -> Rows:
        """`get(name)` not yet read: rows a..b cost only their bytes (and their FP8 scale rows / MXFP4 experts)."""
        shape = self.shape(name)
        self.used.update({name, name + "_blocks", name + "_scales", name + "_scale_inv"} & set(self.weight_map))
        return Rows(shape, lambda a, b: self._rows(name, a, b))

    def get(self, name: str) -> torch.Tensor:
        return self.rows(name).read()

    def _rows(self, name: str, a: int, b: int) -> torch.Tensor:
        if self._method() == "mxfp4" and name not in self.weight_map and name + "_blocks" in self.weight_map:
            return mxfp4_dequantize(self._read(name + "_blocks", a, b), self._read(name + "_scales", a, b))
        t = self._read(name, a, b)
        if self._method() == "fp8" and name + "_scale_inv" in self.weight_map:
            (bo, bi), cols = self.quantization["block"], t.shape[1]
            first = a // bo  # the block rows that hold rows a..b
            scale = self._read(name + "_scale_inv", first, math.ceil(b / bo)).float()
            scale = scale.repeat_interleave(bo, 0)[a - first * bo: b - first * bo].repeat_interleave(bi, 1)
            return t.float() * scale[:, :cols]
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
            raise ConfigError(f"{name} is stored as {t.dtype}: quantized checkpoints are not supported; "
                              f"dequantize to bf16 first")
        return t.float()


def ignorable(name: str, num_layers: int, folder: SafetensorsFolder | None = None) -> bool:
    """Checkpoint tensors moelab does not model: rotary caches, DeepSeek's multi-token-prediction layers, and
    empty tensors (transformers' DeepSeek-V3 with n_shared_experts=0 saves shared experts of width 0)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if folder is not None and ".shared_experts." in name and math.prod(folder.shape(name)) == 0:
        return True
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= num_layers
