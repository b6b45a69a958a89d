"""train.optimizer: which AdamW build_optimizer returns (auto: Triton's kernels only on CUDA; adamw_triton refused
where its kernel cannot run), and that the two are interchangeable: several steps of TritonAdamW (Triton's CPU
interpreter) equal torch's AdamW on the tiny model, and a state dict saved by one loads into the other (same
keys, shapes and dtypes) and continues with the same updates."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moelab.config import ConfigError, load_config
from moelab.train.optim import build_optimizer


def _model(*overrides):
    from moelab.model import MoETransformer

    cfg = load_config("tiny", list(overrides))
    model = MoETransformer(cfg.model, cfg.backend)
    model.init_weights(0)
    return model, cfg


def test_auto_and_adamw_are_torch_adamw_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for choice in ("auto", "adamw"):
        model, cfg = _model(f"train.optimizer={choice}")
        opt = build_optimizer(model, cfg)
        assert type(opt) is torch.optim.AdamW and not opt.defaults["fused"]


def test_adamw_triton_refused_where_its_kernel_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, cfg = _model("train.optimizer=adamw_triton")
    with pytest.raises(ConfigError, match="train.optimizer='adamw_triton'.*(CUDA|triton)"):
        build_optimizer(model, cfg)


CHECK = textwrap.dedent('''
    import copy
    import torch
    from moelab.config import load_config
    from moelab.model import MoETransformer
    from moelab.train.adamw_triton import TritonAdamW
    from moelab.train.optim import build_optimizer

    TritonAdamW.MIN_NUMEL = 64  # the tiny model's matrices go through the kernel, its small vectors through torch

    def setup(choice):
        cfg = load_config("tiny", [f"train.optimizer={choice}", "train.weight_decay=0.1"])
        model = MoETransformer(cfg.model, cfg.backend)
        model.init_weights(0)
        return model, build_optimizer(model, cfg)

    def steps(model, opt, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()

    def close(a, b):
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (n, (p - q).abs().max())

    ref, o_ref = setup("adamw")
    new, o_new = setup("adamw_triton")
    assert type(o_ref) is torch.optim.AdamW and type(o_new) is TritonAdamW
    steps(ref, o_ref, 4, 1); steps(new, o_new, 4, 1)
    close(ref, new)
    # portable state dicts: the same keys, shapes and dtypes; each loads into the other and continues alike
    s_ref, s_new = o_ref.state_dict(), o_new.state_dict()
    assert s_ref["param_groups"] == s_new["param_groups"]
    assert s_ref["state"].keys() == s_new["state"].keys()
    for i, st in s_ref["state"].items():
        assert {k: (v.shape, v.dtype) for k, v in st.items()} == \\
            {k: (v.shape, v.dtype) for k, v in s_new["state"][i].items()}, i
    for load_into, saved_by in (("adamw_triton", s_ref), ("adamw", s_new)):
        a, o_a = setup(load_into)
        with torch.no_grad():
            for p, q in zip(a.parameters(), ref.parameters()):
                p.copy_(q)
        o_a.load_state_dict(copy.deepcopy(saved_by))  # load_state_dict keeps the given tensors: no sharing
        b, o_b = setup("adamw")
        with torch.no_grad():
            for p, q in zip(b.parameters(), ref.parameters()):
                p.copy_(q)
        o_b.load_state_dict(copy.deepcopy(s_ref))
        steps(a, o_a, 2, 2); steps(b, o_b, 2, 2)
        close(a, b)
    print("ok")
''')


def test_triton_adamw_equals_torch_and_state_dicts_are_portable():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
