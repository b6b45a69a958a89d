"""`moelab bench` on CPU: the tiny preset times real training steps and writes a complete result record."""
import json
import subprocess
import sys

from moelab.planner.flops import FLOPS_CONVENTION

REQUIRED = ("system", "workload", "gpus", "gpu_name", "tokens_per_s_per_gpu", "tflops_per_gpu", "peak_memory_gb",
            "flops_convention", "command", "commit", "torch_version")


def test_bench_tiny_cli(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "moelab", "bench", "tiny", "--steps", "3", "--warmup", "1",
                        "--set", "backend.fake_balanced_gate=true", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tokens/s/GPU" in r.stdout and "FLOPs convention" in r.stdout
    # the learned router is the headline, the fake gate labelled beside it
    headline, beside = r.stdout.splitlines()[0], r.stdout.splitlines()[1]
    assert headline.endswith("router: learned") and beside.strip().startswith("fake_balanced (fake gate")
    rec = json.loads(out.read_text())
    assert all(k in rec for k in REQUIRED)
    assert rec["system"] == "moelab" and rec["workload"] == "tiny" and rec["gpus"] == 1
    assert rec["flops_convention"] == FLOPS_CONVENTION and rec["tokens_per_s_per_gpu"] > 0
    assert len(rec["step_times_ms"]) == 3 and rec["step_time_ms"] > 0
    assert rec["tflops_per_gpu"] > 0 and rec["flops_per_token"] > 0
    # the throughput follows from the step time: global batch 8 x seq 64 tokens per step
    assert abs(rec["tokens_per_s_per_gpu"] - 8 * 64 / (rec["step_time_ms"] / 1e3)) < 1e-6 * rec["tokens_per_s_per_gpu"]
    assert rec["router"] == "learned" and rec["fake_balanced_gate"] is False and "real_router" not in rec
    assert rec["fake_router"]["router"] == "fake_balanced" and rec["fake_router"]["tokens_per_s_per_gpu"] > 0
    m = rec["metrics_overhead"]
    assert m["step_time_ms_on"] > 0 and m["step_time_ms_off"] > 0
    assert abs(m["fraction"] - (m["step_time_ms_on"] - m["step_time_ms_off"]) / m["step_time_ms_on"]) < 1e-9


def test_bench_api_without_variants():
    from moelab.train.bench import bench
    from moelab.config import load_config

    rec = bench(load_config("tiny"), steps=1, warmup=0, real_router=False, metrics_overhead=False, command="t")
    assert "fake_router" not in rec and "metrics_overhead" not in rec and rec["command"] == "t"
    assert rec["router"] == "learned"
    assert rec["steps"] == 1 and rec["param_dtype"] == "float32"
    assert rec["compile"] is False and rec["fp8"] == "off"  # every record says how it was computed


def test_step_without_metrics_makes_the_same_updates(tmp_path):
    """bench's metrics-overhead variant differs from the trainer's step only in metrics: the same parameters,
    router bias (aux-loss-free balancing), dynamic capacity and per-expert learning rates after the same steps."""
    import torch

    from moelab.train.bench import step_without_metrics
    from moelab.config import load_config
    from moelab.train.trainer import Trainer

    cfg = load_config("tiny", ["model.moe.bias_update_rate=0.01", "model.moe.capacity_factor=1.5",
                               "model.moe.dynamic_capacity=true", "model.moe.expert_lr_power=0.5",
                               "train.steps=4", "train.save_checkpoints=false"])
    trainers = []
    for name, metrics in (("with", True), ("without", False)):
        tr = Trainer(cfg, tmp_path / name)
        tr.setup()
        for step in (1, 2, 3):
            tr.train_step(step) if metrics else step_without_metrics(tr, step)
        trainers.append(tr)
    a, b = (dict(t.model.state_dict()) for t in trainers)
    assert a.keys() == b.keys()
    biases = [k for k in a if k.endswith("expert_bias")]
    assert biases and any(a[k].abs().sum() > 0 for k in biases)  # the bias did move
    for k in a:
        assert torch.equal(a[k], b[k]), k
    histories = [k for k in a if k.endswith("load_history")]
    assert histories and any(a[k].abs().sum() > 0 for k in histories)  # dynamic capacity saw the loads
    # the per-expert learning rates were applied after each optimizer step (apply() consumes the snapshot)
    assert all(t.expert_lr is not None and t.expert_lr._before is None for t in trainers)
    for t in trainers:
        t.env.shutdown()


def test_bench_puts_the_signal_handlers_back():
    """bench() builds a Trainer whose setup installs stop-signal handlers; they must be gone after it, or a later
    run in the same process chains its SIGTERM to the bench's stale handler, which re-raises it with the
    default action (a test process was killed that way)."""
    import signal

    from moelab.train.bench import bench
    from moelab.config import load_config

    before = signal.getsignal(signal.SIGTERM)
    bench(load_config("tiny", {"model.num_layers": 1, "train.seq_len": 16, "train.global_batch_size": 2,
                               "train.micro_batch_size": 2}), steps=1, warmup=0, metrics_overhead=False)
    assert signal.getsignal(signal.SIGTERM) == before


def test_bench_of_a_fake_gate_alone_says_so():
    """real_router=False times only the config's fake gate: the headline is then the fake figure and the record's
    router kind names it, noise included."""
    from moelab.train.bench import bench
    from moelab.config import load_config

    cfg = load_config("tiny", {"model.num_layers": 1, "train.seq_len": 16, "train.global_batch_size": 2,
                               "train.micro_batch_size": 2, "backend.fake_balanced_gate": True,
                               "backend.fake_gate_noise": 0.5})
    rec = bench(cfg, steps=1, warmup=0, real_router=False, metrics_overhead=False)
    assert rec["router"] == "fake_noise=0.5" and rec["fake_gate_noise"] == 0.5 and rec["fake_balanced_gate"] is True
    assert "fake_router" not in rec


def test_median_ms_leaves_the_warm_up_out_and_takes_the_median():
    """moelab.train.bench.median_ms on CPU (the host's clock): the warm-up calls are run and not timed, and the
    figure is the middle of the timed calls (here a 20 ms sleep between a quick call and a 300 ms one)."""
    import time

    from moelab.train.bench import median_ms

    sleeps = iter([0.5, 0.5, 0.0, 0.3, 0.02])  # two warm-up calls (0.5 s each: a mean would show them), then three
    calls = []

    def fn():
        calls.append(1)
        time.sleep(next(sleeps))

    ms = median_ms(fn, reps=3, warmup=2, device="cpu")
    assert len(calls) == 5
    assert 20 <= ms < 300
