"""The plan as a table: sizes in units that suit them, one meaning per row name, and a refused layout that says
how to fix it (issue 20, item 10)."""
import re

import pytest

from moelab import Session
from moelab.config import ConfigError, load_config
from moelab.planner.plan import _bytes, _flop, plan


def test_a_tiny_model_reads_in_small_units():
    text = str(plan(load_config("tiny")))
    assert not re.search(r"\b0\.00 (GiB|GFLOP)", text), text
    assert "MFLOP" in text and "MiB" in text
    big = str(plan(load_config("qwen3-moe-30b-a3b"), gpus=8))
    assert "GFLOP" in big and "GiB" in big


def test_parameters_names_a_count_and_weights_their_memory():
    rows = dict(plan(load_config("tiny"))._rows())
    assert rows["parameters"].endswith("activated per token")
    assert "  weights" in rows and "  parameters" not in rows
    assert plan(load_config("tiny")).to_dict()["memory"]["parameters"] > 0  # the dict keeps its keys


@pytest.mark.parametrize("n, text", [(0, "0 B"), (512, "512 B"), (3 * 1024 + 256, "3.25 KiB"),
                                     (12.4 * 2**20, "12.4 MiB"), (150 * 2**30, "150 GiB")])
def test_bytes(n, text):
    assert _bytes(n) == text


def test_flop():
    assert _flop(1.18e6) == "1.18 MFLOP" and _flop(23.1e9) == "23.1 GFLOP"


def test_a_batch_that_does_not_split_suggests_the_fix():
    with pytest.raises(ConfigError) as e:
        Session("tiny").plan(gpus=8)
    msg = str(e.value)
    assert msg.startswith("train.global_batch_size=8: must be a multiple of micro_batch_size*dp = 4*8 = 32")
    assert "train.global_batch_size=32" in msg and "train.micro_batch_size=1" in msg
    # each suggestion plans
    assert Session("tiny", train={"global_batch_size": 32}).plan(gpus=8).gpus == 8
    assert Session("tiny", train={"micro_batch_size": 1}).plan(gpus=8).gpus == 8
