"""Preflight: every check a config must pass before a rank trains it, in one place, called the same way by
Session.submit and `moelab run` / `moelab resume` (through moelab.launch.submit.validate, before anything is
submitted) and by the trainer on each rank (executor "rank").

    dims = preflight(cfg, world=2, executor="local")   # a ParallelDims, or a ConfigError naming field, value, fix

What it checks, in order (the config's own value rules ran when it was built: moelab.config.rules, bounds, lora):
- the layout for `world` ranks (moelab.layout.dims.ParallelDims), naming the executor and world in its error;
- the optional packages the backends ask for (DeepEP, Transformer Engine, grouped_gemm), where the ranks run on
  this machine (executors inline, local, and the rank itself): a missing one is refused with its install hint
  (moelab.backends.check_packages); on SLURM the nodes' environment decides, on the rank;
- the metrics exports' packages (TensorBoard, W&B: moelab.loggers.mirror.check_export);
- before submission only (a rank reads its data with the same checks in make_dataset): the data the ranks will
  read (moelab.data.batches.check_data) and a train.init_from checkpoint's fit (moelab.hf.sharded_load.check_init).
"""
from __future__ import annotations

from moelab.config import Config, ConfigError
from moelab.layout.dims import ParallelDims

ON_THIS_MACHINE = ("inline", "local", "rank")  # executors whose ranks import their packages here


def preflight(cfg: Config, world: int, executor: str) -> ParallelDims:
    """Every check above for `cfg` on `world` ranks of `executor` ("inline", "local", "slurm" or "rank");
    returns the layout's ParallelDims."""
    from moelab.backends import check_packages
    from moelab.loggers.mirror import check_export

    try:
        dims = ParallelDims.build(cfg, world)
    except ConfigError as e:
        if executor == "rank":
            raise
        raise ConfigError(f"{e} (config {cfg.name!r} on {world} rank(s) = executor={executor!r}, nproc/nodes/"
                          f"gpus_per_node as given)") from None
    if executor in ON_THIS_MACHINE:
        check_packages(cfg)
    check_export(cfg)
    if executor != "rank":
        from moelab.data.batches import check_data

        check_data(cfg, progress=False)  # every check the ranks make on the data (files, ids, vocabulary)
        if cfg.train.init_from:
            from moelab.hf.sharded_load import check_init

            check_init(cfg)  # a checkpoint that does not fit the model
    return dims
