"""`moelab plan CONFIG --gpus N --gpu KIND`: the predicted step (tokens/s/GPU, TFLOPs/GPU, MFU, the bottleneck,
GPU-hours per billion tokens) and its breakdown, exposed and hidden communication, as text and as JSON."""
import json
import re

import pytest

from moelab.cli import main

NUMBER = r"[\d,.]+"


def test_plan_prints_the_predicted_speed_and_its_breakdown(capsys):
    assert main(["plan", "deepseek-v3", "--gpus", "256", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out.splitlines()
    line = [x for x in out if x.startswith("speed (predicted)")]
    assert line and re.search(rf"{NUMBER} tokens/s/GPU, {NUMBER} TFLOPs/GPU, MFU {NUMBER}% on 256 x H100 SXM 80GB; "
                              rf"step {NUMBER} m?s, bottleneck [\w /+-]+; {NUMBER} GPU-hours per billion tokens",
                              line[0]), line
    parts = [x for x in out if x.strip().startswith("step parts")][0]
    assert "all-to-all" in parts and "pipeline bubble" in parts and "hidden)" in parts  # FSDP's prefetched gathers
    assert any("speed: overlap as moelab's schedule runs it" in x for x in out)


def test_plan_json_carries_the_speed_and_what_is_hidden(capsys):
    assert main(["plan", "deepseek-v3", "--gpus", "256", "--gpu", "h100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["speed"]
    assert {"tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "bottleneck", "gpu_hours_per_billion_tokens",
            "parts_s", "hidden_s"} <= set(d)
    assert d["step_s"] == pytest.approx(sum(d["parts_s"].values()))
    assert d["bottleneck"] in d["parts_s"] and d["hidden_s"]["fsdp"] > 0
