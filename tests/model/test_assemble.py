"""One owner for the model's life (moelab.model.assemble): the package constructs MoETransformer in exactly one
place, and assemble runs its transforms in order (FP8 and LoRA before placement, on the meta device; tying
after a load by assignment)."""
import ast
from pathlib import Path

import pytest
import torch

from moelab.config import ConfigError, load_config
from moelab.model import build_model
from moelab.model.assemble import PURPOSES, assemble

PACKAGE = Path(__file__).resolve().parents[2] / "moelab"


def test_moetransformer_is_constructed_in_one_place():
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name == "MoETransformer":
                    calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("model/assemble.py:"), calls


def test_train_places_the_meta_model_after_fp8_and_lora():
    cfg = load_config("tiny", {"train.lora.rank": 4})
    seen = {}

    class Placed:  # what moelab.parallel.parallelize returns: a holder of the placed model
        def __init__(self, model):
            seen["device"] = {p.device.type for p in model.parameters()}
            seen["adapters"] = sum("lora_" in n for n, _ in model.named_parameters())
            self.model = build_model(cfg)

    loaded = []
    placed = assemble(cfg, "train", place=Placed, load=loaded.append)
    assert seen["device"] == {"meta"} and seen["adapters"] > 0
    assert loaded == [placed.model]  # the load fills the placed model, after placement


def test_lora_model_is_the_random_base_plus_adapters():
    cfg = load_config("tiny", {"train.lora.rank": 4})
    base, lora = build_model(cfg).state_dict(), assemble(cfg, "lora").state_dict()
    assert set(base) < set(lora)
    for name, value in base.items():
        assert torch.equal(lora[name], value), name


def test_load_by_assignment_is_tied_after():
    cfg = load_config("tiny", {"model.tie_embeddings": True})
    state = build_model(cfg).state_dict()
    state = {k: v.clone() for k, v in state.items()}  # the head and the embedding: two tensors
    model = assemble(cfg, "load", load=lambda m: m.load_state_dict(state, strict=True, assign=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.output.weight, state["tok_embeddings.weight"])
    shapes = assemble(cfg, "shapes")
    assert {p.device.type for p in shapes.parameters()} == {"meta"}


def test_bad_purpose_or_placement_is_refused():
    cfg = load_config("tiny")
    with pytest.raises(ValueError, match="purpose='serve'.*" + ", ".join(PURPOSES)):
        assemble(cfg, "serve")
    with pytest.raises(ValueError, match="needs `place`"):
        assemble(cfg, "train")
    with pytest.raises(ValueError, match="takes no `place`"):
        assemble(cfg, "random", place=lambda m: m)
    with pytest.raises(ConfigError, match="train.lora.rank=0"):
        assemble(cfg, "lora")
