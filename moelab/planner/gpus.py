"""GPU kinds as data: the datasheet figures the step-time model (moelab.planner.speed) scales by, each with its
source. Datasheet peaks are not the rates the model computes at: those are measured on this project's H200
(moelab.planner.rates.H200_MEASURED) and carried to another kind by the ratio of these figures.

    gpu_kind("h100").hbm_tb_s          # 3.35
    gpu_kind("H200 141GB").memory_gb   # 141.0
"""
from __future__ import annotations

from dataclasses import dataclass

from moelab.config import ConfigError

_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (https://www.nvidia.com/en-us/data-center/h100/)"
_H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (https://www.nvidia.com/en-us/data-center/h200/)"
_DGX = ("DGX H100/H200 user guide, 'Introduction to the NVIDIA DGX H100/H200 System': 8 GPUs per node, 8 single-port "
        "ConnectX-7 400 Gb/s InfiniBand compute ports, one per GPU "
        "(https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html)")


@dataclass(frozen=True)
class GPUKind:
    """One GPU kind in an 8-GPU node: datasheet figures (dense, i.e. half the with-sparsity TFLOPS the sheets
    print first), bandwidths per GPU and direction, and where each came from.

        k = gpu_kind("h100"); k.bf16_tflops, k.nvlink_gb_s, k.ib_gb_s     # 989.5, 450.0, 50.0
    """
    name: str
    memory_gb: float  # HBM capacity (the planner reads it as GiB, as its 80 GB H100 default does)
    bf16_tflops: float  # dense BF16 tensor-core peak
    fp8_tflops: float  # dense FP8 tensor-core peak
    hbm_tb_s: float  # HBM bandwidth
    nvlink_gb_s: float  # NVLink per GPU, one direction (the sheets' 900 GB/s is both directions)
    ib_gb_s: float  # InfiniBand per GPU between nodes, one direction (400 Gb/s = 50 GB/s)
    gpus_per_node: int
    sources: dict  # field -> where the figure comes from


GPU_KINDS = {
    "h100": GPUKind("H100 SXM 80GB", memory_gb=80.0, bf16_tflops=989.5, fp8_tflops=1979.0, hbm_tb_s=3.35,
                    nvlink_gb_s=450.0, ib_gb_s=50.0, gpus_per_node=8,
                    sources={"memory_gb": _H100_SHEET, "bf16_tflops": _H100_SHEET + ": BF16 1,979 with sparsity",
                             "fp8_tflops": _H100_SHEET + ": FP8 3,958 with sparsity",
                             "hbm_tb_s": _H100_SHEET, "nvlink_gb_s": _H100_SHEET + ": NVLink 900 GB/s",
                             "ib_gb_s": _DGX, "gpus_per_node": _DGX}),
    "h200": GPUKind("H200 SXM 141GB", memory_gb=141.0, bf16_tflops=989.5, fp8_tflops=1979.0, hbm_tb_s=4.8,
                    nvlink_gb_s=450.0, ib_gb_s=50.0, gpus_per_node=8,
                    sources={"memory_gb": _H200_SHEET, "bf16_tflops": _H200_SHEET + ": BF16 1,979 with sparsity",
                             "fp8_tflops": _H200_SHEET + ": FP8 3,958 with sparsity",
                             "hbm_tb_s": _H200_SHEET, "nvlink_gb_s": _H200_SHEET + ": NVLink 900 GB/s",
                             "ib_gb_s": _DGX, "gpus_per_node": _DGX}),
}


def gpu_kind(name: "str | GPUKind") -> GPUKind:
    """The kind named `name` ('h100', 'H100 80GB', 'NVIDIA H200', ...: the first key found in it), or a clear
    error listing the kinds."""
    if isinstance(name, GPUKind):
        return name
    text = str(name).lower()
    for key, kind in GPU_KINDS.items():
        if key in text:
            return kind
    raise ConfigError(f"gpu={name!r}: unknown GPU kind; choose one of {sorted(GPU_KINDS)} "
                      f"(moelab.planner.gpus.GPU_KINDS holds their datasheet figures)")
