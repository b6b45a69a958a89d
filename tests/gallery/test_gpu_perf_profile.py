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


def test_idle_gaps_are_the_waits_between_kernels_with_their_neighbours():
    # a kernel nested in a longer one (another stream) leaves no gap; annotations are not kernels; CPU events
    # are not on the GPU's timeline
    from types import SimpleNamespace as NS

    def ev(name, start_us, end_us, device="CUDA"):
        return NS(name=name, device_type=NS(name=device), time_range=NS(start=start_us, end=end_us))
    events = [ev("gemm", 0, 100), ev("copy", 10, 50), ev("ProfilerStep#1", 0, 2000), ev("add", 130, 140),
              ev("aten::mm", 140, 900, device="CPU"), ev("norm", 1640, 1700), ev("adamw", 1710, 1800)]
    g = gpu_perf.idle_gaps(events)
    assert abs(g["total_ms"] - (0.03 + 1.5 + 0.01)) < 1e-9
    assert g["by_size"]["over_1ms"] == {"count": 1, "ms": 1.5} and g["by_size"]["under_20us"]["count"] == 1
    assert g["by_size"]["20us_to_100us"]["count"] == 1 and g["by_size"]["100us_to_1ms"]["count"] == 0
    assert g["largest"][0] == {"ms": 1.5, "after": "add", "before": "norm"}


def test_host_at_gaps_names_what_each_thread_ran_while_the_gpu_waited():
    # GPU: a 1 ms gap (140 -> 1140 us) and a 50 us one (1200 -> 1250); the main thread is inside a synchronise
    # under the step's op at the first and between ops at the second; the autograd thread runs one op at the
    # first and has ended its ops by the second (not counted there); gaps under 20 us are not counted
    from types import SimpleNamespace as NS

    def ev(name, start_us, end_us, device="CUDA", thread=0):
        return NS(name=name, device_type=NS(name=device), time_range=NS(start=start_us, end=end_us), thread=thread)
    events = [ev("gemm", 0, 140), ev("add", 1140, 1200), ev("norm", 1250, 1300), ev("mul", 1310, 1320),
              ev("train_step", 0, 1180, "CPU", 1), ev("cudaStreamSynchronize", 500, 800, "CPU", 1),
              ev("aten::item", 450, 850, "CPU", 1), ev("aten::add", 1240, 1260, "CPU", 1),
              ev("SonicBackward", 600, 700, "CPU", 2)]
    h = gpu_perf.host_at_gaps(events)
    assert h["gaps"] == 2 and abs(h["gap_ms"] - 1.05) < 1e-9
    assert h["by_innermost"][0] == {"ms": 1.0, "host": "thread 1: cudaStreamSynchronize"}
    assert {"ms": 1.0, "host": "thread 2: SonicBackward"} in h["by_innermost"]
    assert {"ms": 0.05, "host": "thread 1: between ops"} in h["by_innermost"]
    assert h["by_chain"][0]["host"] == "thread 1: train_step > cudaStreamSynchronize"
    assert h["largest"][0] == {"ms": 1.0, "host": ["thread 1: train_step > cudaStreamSynchronize",
                                                   "thread 2: SonicBackward > SonicBackward"]}
    assert not any("thread 2" in host for host in h["largest"][1]["host"])
