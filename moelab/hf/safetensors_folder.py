"""Reading HF checkpoint folders: safetensors files or shards, block-FP8 and MXFP4 weights dequantized on read.

    tensors = SafetensorsFolder(Path("Qwen3-30B-A3B"), quantization(json.load(open(".../config.json"))))
    w = tensors.get("model.embed_tokens.weight")      # fp32
"""
from __future__ import annotations

import json
from pathlib import Path

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


class SafetensorsFolder:
    """Lazy access to the tensors of a checkpoint folder (one file, or shards with an index json); FP8 weights
    with a `<name>_scale_inv` block scale are dequantized to fp32 as they are read.

        folder = SafetensorsFolder(path); "lm_head.weight" in folder; folder.get("lm_head.weight")
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
            raise ConfigError(f"{path}: no *.safetensors files")
        self.path, self.weight_map, self.used, self.quantization = path, weight_map, set(), quantization

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map or (self._method() == "mxfp4" and name + "_blocks" in self.weight_map)

    def _method(self) -> str | None:
        return self.quantization["method"] if self.quantization else None

    def _read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        self.used.add(name)
        with safe_open(str(self.path / self.weight_map[name]), framework="pt") as st:
            return st.get_tensor(name)

    def get(self, name: str) -> torch.Tensor:
        if self._method() == "mxfp4" and name not in self.weight_map and name + "_blocks" in self.weight_map:
            return mxfp4_dequantize(self._read(name + "_blocks"), self._read(name + "_scales"))
        if name not in self.weight_map:
            raise ConfigError(f"{self.path}: checkpoint tensor {name!r} is missing")
        t = self._read(name)
        if self._method() == "fp8" and name + "_scale_inv" in self.weight_map:
            scale = self._read(name + "_scale_inv").float()
            (bo, bi), (rows, cols) = self.quantization["block"], t.shape
            scale = scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
            return t.float() * scale
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
            raise ConfigError(f"{name} is stored as {t.dtype}: quantized checkpoints are not supported; "
                              f"dequantize to bf16 first")
        return t.float()


def ignorable(name: str, num_layers: int, folder: SafetensorsFolder | None = None) -> bool:
    """Checkpoint tensors moelab does not model: rotary caches, DeepSeek's multi-token-prediction layers, and
    empty tensors (transformers' DeepSeek-V3 with n_shared_experts=0 saves shared experts of width 0)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if folder is not None and ".shared_experts." in name and folder.get(name).numel() == 0:
        return True
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= num_layers
