"""`hf:PATH` as a config source: the config of a run that starts from a Hugging Face checkpoint folder.

    cfg = load_config("hf:ckpt/Qwen3-30B-A3B", {"train.steps": 100})   # model from config.json, weights later
    cfg.train.init_from                                                # 'hf:/abs/ckpt/Qwen3-30B-A3B'

The model (and the backend fields a family needs) come from config.json with the mapping `load_hf` uses
(moelab.hf.config_from_hf, refusing what moelab cannot honour); `train.init_from` records the folder, as an
absolute path, so every rank (and a resume) reads the same weights (moelab.hf.sharded_load).
"""
from __future__ import annotations

import json
from pathlib import Path

from moelab.config import Config, ConfigError
from moelab.config import load_config as _load_config


def checkpoint_folder(spec: str, field: str = "source") -> Path:
    """The folder of `hf:PATH`, refused (ConfigError) unless it holds config.json and safetensors weights."""
    path = Path(spec.removeprefix("hf:")).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"{field}={spec!r}: {path} is not a folder; give hf:PATH of a Hugging Face checkpoint "
                          f"folder (config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{field}={spec!r}: {path} has no config.json; give the folder save_pretrained wrote "
                          f"(config.json + *.safetensors)")
    if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("*.safetensors")):
        raise ConfigError(f"{field}={spec!r}: {path} has no weights (*.safetensors); download or save the "
                          f"weights into the folder (only safetensors are read, not .bin / .pt)")
    return path


def read_hf_config(path: Path, field: str = "source") -> dict:
    """config.json of a checkpoint folder, as a dict."""
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field}=hf:{path}: config.json cannot be read ({e}); give a valid config.json") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{field}=hf:{path}: config.json holds no mapping; give a transformers config.json")
    return hf


def config_dict(spec: str) -> dict:
    """The whole config dict (defaults filled) of `hf:PATH`: config.json mapped, train.init_from set."""
    from moelab.hf import config_from_hf

    path = checkpoint_folder(spec)
    d = Config.from_dict(config_from_hf(read_hf_config(path))).to_dict()
    d["train"]["init_from"] = f"hf:{path}"
    return d


def load_config(source, overrides=None) -> Config:
    """moelab.config.load_config that also reads `hf:PATH` sources and YAML `base: hf:PATH`."""
    return _load_config(source, overrides, readers={"hf": config_dict})
