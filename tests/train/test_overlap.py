"""moelab.train.overlap: the optimizer's step in the forward's order, stage by stage, is bitwise one step; the
forward waits for each stage where it first uses it (compiled blocks too); the trainer with the overlap trains
exactly as without it. On the CPU torch.cpu's streams and events are no-ops, so these run the real class in
order; the GPU's streams are checked by gallery/scripts/gpu_check_overlap.py."""
import pytest
import torch

from moelab.config import load_config
from moelab.contract.stream import read_events
from moelab.model.transformer import MoETransformer
from moelab.train.optim import build_optimizer
from moelab.train.overlap import OptimizerOverlap, applies, stages, staged_step, wait_points
from moelab.train.trainer import Trainer


def _model(*overrides):
    cfg = load_config("tiny", list(overrides))
    torch.manual_seed(0)
    model = MoETransformer(cfg.model)
    model.init_weights(seed=0)
    return model, cfg


def test_stages_are_the_forward_order_and_hold_every_parameter_once():
    model, cfg = _model()
    opt = build_optimizer(model, cfg)
    got = stages(model, opt)
    n = cfg.model.num_layers
    assert len(got) == n + 2
    ids = lambda ps: {id(p) for p in ps}
    assert ids(got[0]) == ids(model.tok_embeddings.parameters())
    for i, block in enumerate(model.layers.values()):
        assert ids(got[i + 1]) == ids(block.parameters())
    assert ids(got[-1]) == ids(model.norm.parameters()) | ids(model.output.parameters())
    flat = [id(p) for ps in got for p in ps]
    assert sorted(flat) == sorted(id(p) for g in opt.param_groups for p in g["params"])


def test_a_tied_head_is_updated_with_the_embedding():
    model, cfg = _model("model.tie_embeddings=true")
    got = stages(model, build_optimizer(model, cfg))
    assert any(p is model.tok_embeddings.weight for p in got[0])
    assert not any(p is model.output.weight for p in got[-1])  # the same tensor, once


def test_the_forward_waits_for_each_stage_where_it_first_uses_it():
    model, _ = _model()
    points = wait_points(model, len(model.layers) + 2)
    assert points[0] == (model, (0,))
    assert [m for m, _ in points[1:-1]] == list(model.layers.values())
    assert [w for _, w in points[1:-1]] == [(i + 1,) for i in range(len(model.layers))]
    assert points[-1] == (model.norm, (len(model.layers) + 1,))
    model.norm = None  # no final norm: the last stage is waited for at the start
    assert wait_points(model, 4)[0] == (model, (0, 3))


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_a_staged_step_is_bitwise_one_step(param_dtype):
    ref, cfg = _model(f"train.param_dtype={param_dtype}", "train.dtype=bfloat16", "train.weight_decay=0.1")
    new, _ = _model(f"train.param_dtype={param_dtype}", "train.dtype=bfloat16", "train.weight_decay=0.1")
    dtype = torch.bfloat16 if param_dtype == "bfloat16" else torch.float32
    ref.to(dtype), new.to(dtype)
    o_ref, o_new = build_optimizer(ref, cfg), build_optimizer(new, cfg)
    order = stages(new, o_new)
    seen = []
    for step in range(3):
        _grads(ref, step), _grads(new, step)
        o_ref.step()
        staged_step(o_new, order, lambda i, grads: seen.append((i, len(grads))))
        assert all(p.grad is None for p in new.parameters())
    for (name, a), b in zip(ref.named_parameters(), new.parameters()):
        assert torch.equal(a, b), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o_ref.state[a][key], o_new.state[b][key]), (name, key)
    assert seen[:len(order)] == [(i, len(ps)) for i, ps in enumerate(order)]


def test_it_applies_on_one_cuda_process_without_a_pipeline():
    auto, off = load_config("tiny"), load_config("tiny", ["train.optimizer_overlap=off"])
    assert applies(auto, 1, on_cuda=True, pipeline=False)
    assert not applies(off, 1, on_cuda=True, pipeline=False)
    assert not applies(auto, 2, on_cuda=True, pipeline=False)
    assert not applies(auto, 1, on_cuda=False, pipeline=False)
    assert not applies(auto, 1, on_cuda=True, pipeline=True)


def test_compiled_blocks_still_wait_at_every_call():
    """The blocks are compiled with their hooks (Block.compile): the wait runs as a host call at each forward."""
    torch._dynamo.reset()
    model, cfg = _model()
    opt = build_optimizer(model, cfg)
    overlap = OptimizerOverlap(model, opt)
    waited = []
    overlap._wait = lambda stage: waited.append(stage)
    for block in model.layers.values():
        block.compile(backend="aot_eager")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    for _ in range(2):
        model(tokens).float().sum().backward()
    assert waited == ([0] + [i + 1 for i in range(len(model.layers))] + [len(model.layers) + 1]) * 2
    overlap._wait = OptimizerOverlap._wait.__get__(overlap)
    overlap.remove()
    waited.clear()
    model(tokens)
    assert waited == []


def _run(tmp_path, name, overlap: bool, *overrides):
    cfg = load_config("tiny", ["train.steps=4", "train.global_batch_size=8", "train.micro_batch_size=4",
                               "train.checkpoint_every=2", *overrides])
    tr = Trainer(cfg, tmp_path / name)
    if overlap:  # CPU: attach() leaves it off; the real class with torch.cpu's streams
        setup = tr.setup

        def setup_with_overlap():
            setup()
            tr.overlap = OptimizerOverlap(tr.model, tr.optimizer)
            tr.calls = []
            step = tr.overlap.step
            tr.overlap.step = lambda: (tr.calls.append("step"), step())
        tr.setup = setup_with_overlap
    tr.run()
    losses = [e["loss"] for e in read_events(tmp_path / name / "metrics.jsonl") if e["event"] == "step"]
    return tr, losses


@pytest.mark.parametrize("overrides", [[], ["train.eval_every=2"]])
def test_the_trainer_with_the_overlap_trains_exactly_as_without(tmp_path, overrides):
    plain, l_plain = _run(tmp_path, "plain", False, *overrides)
    over, l_over = _run(tmp_path, "over", True, *overrides)
    assert over.calls == ["step"] * 4  # the overlap made every update
    assert l_over == l_plain
    for (name, a), b in zip(plain.model.named_parameters(), over.model.parameters()):
        assert torch.equal(a, b), name
    assert all(e is None for e in over.overlap.events)  # the run's end joined the last update
