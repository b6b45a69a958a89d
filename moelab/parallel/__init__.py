"""Parallelism, applied to a model that has none: ``parallelize(model, cfg, env, layout) -> Parallelized``.

    dims = ParallelDims.build(cfg, world_size=8)       # moelab.layout.dims: torch-free, validates the layout
    par = parallelize(model, cfg, env, dims)           # moelab.parallel.apply: one process or several

The names load when first asked for, so that the torch-free parts (dims: the layout validator; env: who am I)
import without torch.
"""
__all__ = ["Parallelized", "parallelize", "apply_activation_checkpointing", "apply_compile", "materialize",
           "ParallelDims", "DistEnv"]


def __getattr__(name):
    if name == "ParallelDims":
        from moelab.parallel import dims as module
    elif name == "DistEnv":
        from moelab.parallel import env as module
    elif name == "parallelize":
        from moelab.parallel import apply as module
    elif name in __all__:
        from moelab.parallel import place as module
    else:
        raise AttributeError(f"module 'moelab.parallel' has no attribute {name!r}")
    return getattr(module, name)
