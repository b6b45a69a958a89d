"""gallery/scripts/gpu_perf.py's profile summary: user annotations on the GPU timeline (the optimizer's
`Optimizer.step#AdamW.step` range) span kernels already counted and are left out of the sums and the idle time."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gallery" / "scripts"))

import gpu_perf  # noqa: E402


def test_annotations_are_not_counted_as_kernels():
    kernels = [("Optimizer.step#AdamW.step", 29.9),
               ("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 29.3),
               ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 60.0), ("ProfilerStep#3", 140.0)]
    p = gpu_perf.summarize_kernels(kernels, step_ms=100.0)
    assert p["by_category_ms"] == {"matmul": 60.0, "optimizer": 29.3}
    assert abs(p["gpu_busy_ms"] - 89.3) < 1e-9 and abs(p["idle_ms"] - 10.7) < 1e-9
    assert [k["name"] for k in p["top_kernels"]][0].startswith("nvjet")
