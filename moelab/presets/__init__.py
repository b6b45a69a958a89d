"""Named configs. Each preset is a YAML file in this folder, in the same dialect users write.

A ``<name>-proxy`` preset keeps every layer shape of ``<name>`` (hidden size, heads, experts, top-k, expert width,
vocabulary) and trains only a few layers, so that it fits on one GPU. Exception: one full MoE layer of DeepSeek-V3
(256 experts) or Kimi-K2 (384) alone outgrows an H200 with Adam, so their proxies also keep fewer experts (64, 48).
"""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def preset_names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def preset_path(name: str) -> Path:
    return HERE / f"{name}.yaml"
