"""Helpers shared by tests in several folders (pyproject puts tests/_support on sys.path for pytest)."""
from __future__ import annotations

import os
import subprocess
import sys

import torch


def run_one_thread(cfg, run_dir):
    """Train `cfg` in this process on one CPU thread, like each launched rank (on a busy machine OpenMP's
    spinning threads slow small kernels down a hundredfold); returns the finished Trainer."""
    from moelab.parallel.env import DistEnv
    from moelab.train.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(cfg, run_dir, env=DistEnv())
        trainer.run()
    finally:
        torch.set_num_threads(threads)
    return trainer


def pytest_under_interpreter(test_file: str, passed: int, *args: str, timeout: int = 900) -> None:
    """Run `test_file`'s tests (more pytest arguments in `args`, e.g. "-k", EXPR) in a subprocess with
    TRITON_INTERPRET=1, which has to be set before triton is imported, and assert that exactly `passed` passed."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, *args],
                       env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and f"{passed} passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


# A small model for command-line tests: `moelab run tiny *SMALL_CLI ...` trains in seconds on one CPU thread.
SMALL_CLI = ["--set", "model.num_layers=2", "--set", "model.hidden_size=32", "--set", "model.moe.num_experts=4",
             "--set", "model.moe.expert_ffn_size=32", "--set", "train.seq_len=16", "--set",
             "train.global_batch_size=4", "--set", "train.micro_batch_size=2", "--set", "train.device=cpu"]


def moelab_cli(*args, timeout=300, **kw):
    """`python -m moelab ARGS` in a subprocess (arguments turned into strings); its CompletedProcess, output kept."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "moelab", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)


def fill_disk(folder) -> None:
    """Fill the file system of `folder` up to the last byte (a file `filler` in it; remove it to free the space)."""
    import os

    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 4096, 1):
            while True:
                try:
                    if os.write(fd, b"x" * size) < size:
                        break
                except OSError:
                    break
    finally:
        os.close(fd)
