"""`moelab plan CONFIG --gpus N --gpu KIND`: the predicted step (tokens/s/GPU, TFLOPs/GPU, MFU, the bottleneck,
GPU-hours per billion tokens) and its breakdown, exposed and hidden communication, as text and as JSON."""
import json
import re

import pytest

from moelab.cli import main

NUMBER = r"[\d,.]+"


FITS = ["--set", "train.optimizer_state=bf16_moments"]  # the preset's layout on 256 H100s, as README's line


def test_plan_prints_the_predicted_speed_and_its_breakdown(capsys):
    assert main(["plan", "deepseek-v3", "--gpus", "256", "--gpu", "h100", *FITS]) == 0
    out = capsys.readouterr().out.splitlines()
    line = [x for x in out if x.startswith("speed (predicted)")]
    assert line and re.search(rf"{NUMBER} tokens/s/GPU, {NUMBER} TFLOPs/GPU, MFU {NUMBER}% on 256 x H100 SXM 80GB; "
                              rf"step {NUMBER} m?s, bottleneck [\w /+-]+; {NUMBER} GPU-hours per billion tokens",
                              line[0]), line
    parts = [x for x in out if x.strip().startswith("step parts")][0]
    assert "all-to-all" in parts and "pipeline bubble" in parts and "hidden)" in parts  # FSDP's prefetched gathers
    assert any("speed: overlap as moelab's schedule runs it" in x for x in out)
    bound = [x for x in out if x.strip().startswith("bound")][0]
    assert re.search(rf"bounds the step \({NUMBER}%\); communication {NUMBER} m?s exposed, {NUMBER} m?s hidden; "
                     rf"with all of it hidden {NUMBER} tokens/s/GPU \({NUMBER}x\)", bound), bound


def test_a_plan_that_does_not_fit_names_a_setting_that_fits_and_prints_no_speed(capsys):
    assert main(["plan", "deepseek-v3", "--gpus", "256", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    verdict = [x for x in out.splitlines() if x.startswith("verdict")][0]
    assert "does not fit" in verdict and "the biggest term is optimizer state" in verdict
    flags = re.search(r"Fits with ((?:--set \S+ ?)+):", verdict).group(1).split()
    assert "tokens/s/GPU" not in out and "none: the layout does not fit" in out
    assert main(["plan", "deepseek-v3", "--gpus", "256", "--gpu", "h100", *flags]) == 0  # ... and it fits
    again = capsys.readouterr().out
    assert "verdict                            fits:" in again and "tokens/s/GPU" in again


def test_plan_json_carries_the_speed_and_what_is_hidden(capsys):
    assert main(["plan", "deepseek-v3", "--gpus", "256", "--gpu", "h100", "--json", *FITS]) == 0
    d = json.loads(capsys.readouterr().out)["speed"]
    assert {"tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "bottleneck", "gpu_hours_per_billion_tokens",
            "parts_s", "hidden_s"} <= set(d)
    assert d["step_s"] == pytest.approx(sum(d["parts_s"].values()))
    assert d["bottleneck"] in d["parts_s"] and d["hidden_s"]["fsdp"] > 0
