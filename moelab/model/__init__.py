"""moelab's model: a decoder-only MoE transformer in plain PyTorch, with no parallelism in it."""
from moelab.model.moe import MoE
from moelab.model.router import Router
from moelab.model.transformer import MoETransformer


def build_model(cfg, device="cpu"):
    """The model of a moelab Config, initialised deterministically from cfg.train.seed.

        model = build_model(load_config("tiny"))
    """
    import torch

    with torch.device(device):
        model = MoETransformer(cfg.model, cfg.backend)
    model.init_weights(cfg.train.seed)
    return model


__all__ = ["MoE", "Router", "MoETransformer", "build_model"]
