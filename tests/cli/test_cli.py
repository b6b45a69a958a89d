"""The CLI acceptance path: `moelab run tiny --steps 50 --out DIR` and its error messages."""
import subprocess
import sys

from moelab.contract.stream import read_events


def moelab(*args, **kw):
    return subprocess.run([sys.executable, "-m", "moelab", *args], capture_output=True, text=True, timeout=300, **kw)


def test_run_tiny_50_steps(tmp_path):
    r = moelab("run", "tiny", "--steps", "50", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "COMPLETED at step 50/50" in r.stdout and "routing balance per MoE layer" in r.stdout
    steps = [e for e in read_events(tmp_path / "run" / "metrics.jsonl") if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 51))
    # a first run ends clean: no warning the user did not cause (torch.distributed.checkpoint's "torch.distributed
    # is disabled ... assuming the intent is to save in a single process" on one process), no traceback
    assert "Warning" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_presets_and_clear_errors(tmp_path):
    r = moelab("presets")
    assert r.returncode == 0 and "tiny" in r.stdout and "qwen3-moe-30b-a3b" in r.stdout
    r = moelab("run", "tinyy", "--out", str(tmp_path))
    assert r.returncode == 2 and "unknown preset 'tinyy'" in r.stderr and "Presets:" in r.stderr
    r = moelab("run", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = moelab("run", "tiny", "--set", "model.moe.top_k=99")
    assert r.returncode == 2 and "model.moe.top_k=99" in r.stderr
