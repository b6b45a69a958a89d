"""moelab: drive large-scale Mixture-of-Experts training from a Jupyter notebook.

    from moelab import Session
    run = Session("tiny", train={"steps": 20}).submit()
    run.dashboard()
"""
from moelab.config import Config, ConfigError, load_config, save_config
from moelab.run.run import Run
from moelab.run.sweep import Sweep, runs
from moelab.run.session import Session

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "load_config", "save_config", "Run", "Session", "Sweep", "runs",
           "load_hf", "save_hf"]


def __getattr__(name):  # load_hf/save_hf import torch and the model: only when asked for
    if name in ("load_hf", "save_hf"):
        from moelab import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'moelab' has no attribute {name!r}")
