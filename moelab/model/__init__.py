"""moelab's model: a decoder-only MoE transformer in plain PyTorch, with no parallelism in it."""
from moelab.model.batch_context import BatchContext
from moelab.model.moe import MoE
from moelab.model.router import Router
from moelab.model.transformer import MoETransformer


def build_model(cfg, device="cpu"):
    """The model of a moelab Config, initialised deterministically from cfg.train.seed (moelab.model.assemble).

        model = build_model(load_config("tiny"))
    """
    from moelab.model.assemble import assemble

    return assemble(cfg, "random", device)


__all__ = ["BatchContext", "MoE", "Router", "MoETransformer", "build_model"]
