"""Runs: the run folder (the contract every writer and reader shares), Run and Sweep (handles on folders).

    from moelab.run import Run, Sweep, runs     # the public nouns (also moelab.Run, moelab.Sweep, moelab.runs)
    from moelab.contract.folder import RunFolder     # file names, atomic JSON, run.json

The nouns load when first asked for, so that the trainer and the launcher, which write run folders, can stand
on moelab.contract.folder without importing Run (which stands on them).
"""
__all__ = ["Run", "STATES", "TERMINAL", "Sweep", "runs"]


def __getattr__(name):
    if name in ("Run", "STATES", "TERMINAL"):
        from moelab.run import run as module
    elif name in ("Sweep", "runs"):
        from moelab.run import sweep as module
    else:
        raise AttributeError(f"module 'moelab.run' has no attribute {name!r}")
    return getattr(module, name)
