"""Kept for old imports (moelab/hf.py): the per-layer shapes are in moelab.planner.shapes, the pipeline's
stage split in moelab.planner.stages."""
from moelab.planner.shapes import layer_window, layer_windows  # noqa: F401
from moelab.planner.stages import layer_costs, stage_layers  # noqa: F401
