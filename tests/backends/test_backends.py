"""The switchboard's guards on CPU: a missing or unsupported backend package gives an error naming the package and
how to install it; backend.fallback=true falls back to the torch path with a warning, never silently."""
import subprocess
import sys

import pytest
import torch

import moelab.backends as backends
from moelab.backends import BackendUnavailable, check_backends, detected, import_package
from moelab.config import ConfigError, load_config


DEEPEP_LAYOUT = {"parallel.ep": 2, "train.dtype": "bfloat16"}  # what config_rules asks of backend.dispatcher=deepep


def cfg(**over):
    if over.get("backend.dispatcher") == "deepep":
        over = {**DEEPEP_LAYOUT, **over}
    return load_config("tiny", {"train.steps": 2, **over})


def missing(key):
    if detected()[key]:
        pytest.skip(f"{key} is installed here")


@pytest.mark.parametrize("field,value,package,key", [
    ("backend.experts", "grouped_gemm", "grouped_gemm", "grouped_gemm"),
    ("backend.experts", "te", "transformer-engine", "te"),
    ("backend.attention", "te", "transformer-engine", "te"),
    ("backend.dispatcher", "deepep", "deep-ep", "deep_ep"),
])
def test_missing_package_is_a_clear_error(field, value, package, key):
    missing(key)
    with pytest.raises(BackendUnavailable) as e:
        check_backends(cfg(**{field: value}), device="cpu")
    msg = str(e.value)
    assert f"{field}={value!r}" in msg and package in msg and "not installed" in msg
    assert "backend.fallback=true" in msg and "Install:" in msg or "install" in msg
    assert isinstance(e.value, ConfigError)


def test_fallback_warns_and_uses_the_torch_path():
    missing("grouped_gemm")
    missing("deep_ep")
    c = cfg(**{"backend.experts": "grouped_gemm", "backend.dispatcher": "deepep", "backend.fallback": True})
    with pytest.warns(RuntimeWarning, match="falling back to backend.experts='auto'"):
        chosen = check_backends(c, device="cpu")
    assert chosen == {"experts": "auto", "attention": "sdpa", "dispatcher": "all_to_all",
                      "loss": "chunked"}


def test_installed_but_unsupported_hardware(monkeypatch):
    monkeypatch.setitem(backends._DETECTED, "grouped_gemm", True)  # as if installed: the hardware check decides
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU.*this run is on 'cpu'"):
        check_backends(cfg(**{"backend.experts": "grouped_gemm"}), device="cpu")
    monkeypatch.setitem(backends._DETECTED, "deep_ep", True)
    with pytest.raises(BackendUnavailable, match="Hopper"):
        check_backends(cfg(**{"backend.dispatcher": "deepep"}), device="cpu", world_size=2)


def test_torch_paths_need_nothing():
    assert check_backends(cfg(), device="cpu") == {"experts": "auto", "attention": "sdpa",
                                                   "dispatcher": "all_to_all", "loss": "chunked"}


def test_import_package_and_modules_guard():
    missing("te")
    missing("deep_ep")
    with pytest.raises(BackendUnavailable, match="transformer-engine"):
        import_package("te")
    from moelab.parallel.deepep import DeepEPDispatcher
    from moelab.backends.te import TEGroupedExperts

    with pytest.raises(BackendUnavailable, match="deep-ep"):
        DeepEPDispatcher(group=None, hidden=64)
    with pytest.raises(BackendUnavailable, match="transformer-engine"):
        TEGroupedExperts(4, 8, 8)


def test_grouped_gemm_kernel_guards_biases():
    from moelab.backends import experts_kernel
    from moelab.model.experts import GroupedExperts

    with pytest.raises(BackendUnavailable, match="without biases"):
        experts_kernel("grouped_gemm", GroupedExperts(4, 8, 8, bias=True))
    with pytest.raises(BackendUnavailable, match="no stacked-weight kernel"):
        experts_kernel("te")


def test_trainer_with_fallback_trains_on_the_torch_path(tmp_path):
    missing("grouped_gemm")
    from moelab.train.trainer import Trainer

    tr = Trainer(cfg(**{"backend.experts": "grouped_gemm", "backend.fallback": True}), tmp_path / "run")
    try:
        with pytest.warns(RuntimeWarning, match="grouped_gemm"):
            tr.setup()
        rec = tr.train_step(1)
    finally:
        tr.stop.restore()
    assert rec["loss"] == rec["loss"] and rec["loss"] > 0 and not rec["skipped"]
    assert tr.model.backends["experts"] == "auto"
    assert all(m.experts.impl == "auto" for m in tr.model.moe_layers())


def test_cli_names_the_missing_package(tmp_path):
    missing("grouped_gemm")
    r = subprocess.run([sys.executable, "-m", "moelab", "run", "tiny", "--steps", "2", "--out", str(tmp_path / "r"),
                        "--set", "backend.experts=grouped_gemm"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "grouped_gemm" in r.stderr and "not installed" in r.stderr and "backend.fallback=true" in r.stderr


def test_gmm_path_matches_torch_reference_on_cpu(monkeypatch):
    """The grouped_gemm adapter's slicing of dropped rows and its output layout, with a stand-in gmm that computes
    per-expert matmuls (the real kernel is checked on the GPU by gallery/scripts/check_backends_gpu.py)."""
    import types

    from moelab.backends.gmm import gmm_swiglu
    from moelab.model.experts import loop_swiglu

    def fake_gmm(a, b, batch_sizes, trans_b=False):
        assert batch_sizes.device.type == "cpu" and int(batch_sizes.sum()) == a.shape[0]
        return torch.cat([x @ w for x, w in zip(a.split(batch_sizes.tolist()), b)])

    mod = types.ModuleType("grouped_gemm.ops")
    mod.gmm = fake_gmm
    monkeypatch.setitem(sys.modules, "grouped_gemm", types.ModuleType("grouped_gemm"))
    monkeypatch.setitem(sys.modules, "grouped_gemm.ops", mod)
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(40, 8, generator=g), torch.randn(4, 8, 12, generator=g), torch.randn(4, 6, 8, generator=g)
    counts = torch.tensor([10, 0, 17, 9])  # 36 of 40 rows counted: 4 dropped rows come back as zeros
    y = gmm_swiglu(x, w1, w2, counts)
    ref = loop_swiglu(x, w1, w2, counts)
    assert torch.allclose(y[:36], ref[:36], atol=1e-5) and (y[36:] == 0).all()


@pytest.mark.parametrize("over,match", [
    ({}, "needs a CUDA GPU.*this run is on 'cpu'"),
    ({"model.moe.capacity_factor": 1.25}, "every assignment kept.*capacity_factor=1.25"),
    ({"model.moe.expert_proj_bias": True}, "plain SwiGLU experts"),
])
def test_triton_fused_is_refused_where_its_kernels_do_not_apply(monkeypatch, over, match):
    # the fused kernels read each routed row from a token on this rank and keep every assignment
    monkeypatch.setitem(backends._DETECTED, "triton", True)
    with pytest.raises(BackendUnavailable, match=match):
        check_backends(cfg(**{"backend.experts": "triton_fused", **over}), device="cpu")
    with pytest.warns(RuntimeWarning, match="falling back to backend.experts='auto'"):
        chosen = check_backends(cfg(**{"backend.experts": "triton_fused", "backend.fallback": True, **over}),
                                device="cpu")
    assert chosen["experts"] == "auto"


def test_triton_fused_experts_keep_the_torch_path_on_sorted_rows():
    # expert parallelism's rows arrive sorted from other ranks (GroupedExperts.forward, not on_tokens): torch's path
    from moelab.model.experts import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 16)
    torch.nn.init.normal_(experts.w_gate_up_EDF2)
    torch.nn.init.normal_(experts.w_down_EFD)
    x_ND, counts_E = torch.randn(10, 8), torch.tensor([3, 0, 4, 3])
    want = experts(x_ND, counts_E)
    experts.impl = "triton_fused"
    assert torch.equal(experts(x_ND, counts_E), want)
    experts.lora_rank = 2
    with pytest.raises(ValueError, match="triton_fused.*use backend.experts=auto"):
        experts.on_tokens(torch.randn(5, 8), torch.ones(5, 2), torch.arange(10), counts_E)


@pytest.mark.parametrize("experts", ["grouped_gemm", "te"])
def test_grouped_backends_refuse_experts_they_would_compute_wrongly(monkeypatch, experts):
    # GPT-OSS experts have biases and a clamped SwiGLU that these kernels do not compute: refuse, never drop them
    monkeypatch.setitem(backends._DETECTED, "grouped_gemm", True)
    monkeypatch.setitem(backends._DETECTED, "te", True)
    gpt_oss_like = {"backend.experts": experts, "model.moe.expert_proj_bias": True, "model.moe.activation": "gpt_oss"}
    with pytest.raises(BackendUnavailable, match="plain SwiGLU experts.*use backend.experts=auto"):
        check_backends(cfg(**gpt_oss_like), device="cuda")


def test_installed_but_broken_te_names_the_real_cause(tmp_path):
    """TE installed but its torch extension cannot load (a wrong CUDA/torch build): the error names the module
    that failed and the innermost cause, not an AttributeError. A real package on disk, imported for real."""
    pkg = tmp_path / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pytorch" / "__init__.py").write_text(
        "try:\n    import transformer_engine_torch_missing_ext\n"
        "except ImportError as e:\n    raise RuntimeError('transformer_engine_torch failed to load') from e\n")
    code = ("from moelab.backends import import_package, BackendUnavailable\n"
            "try:\n    import_package('te')\nexcept BackendUnavailable as e:\n    print('ERR', e)\n")
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    msg = out.stdout
    assert msg.startswith("ERR") and "transformer_engine.pytorch does not import" in msg
    assert "transformer_engine_torch failed to load" in msg
    assert "No module named 'transformer_engine_torch_missing_ext'" in msg  # the innermost cause


MLA = {"model.attention": "mla", "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8,
       "model.qk_rope_head_dim": 8, "model.v_head_dim": 8}


@pytest.mark.parametrize("over,ok", [
    ({"backend.te_fp8": "current"}, False),  # needs backend.attention=te
    ({"backend.te_fp8": "block", "backend.attention": "te"}, True),
    ({"backend.te_fp8": "current", "backend.attention": "te", **MLA}, False),
])
def test_te_fp8_recipes_are_validated(over, ok):
    if ok:
        assert cfg(**over).backend.te_fp8 == over["backend.te_fp8"]
        return
    with pytest.raises(ConfigError, match="backend.te_fp8"):
        cfg(**over)


def test_te_attention_is_accepted_for_mla_and_sinks(monkeypatch):
    """MLA and GPT-OSS's sinks are no longer refused by the TE attention backend: with TE present, only the
    hardware decides (here: a CPU run)."""
    monkeypatch.setitem(backends._DETECTED, "te", True)
    for c in (cfg(**{"backend.attention": "te", **MLA}),
              cfg(**{"backend.attention": "te", "model.attention_sinks": True})):
        with pytest.raises(BackendUnavailable, match="this run is on 'cpu'"):
            check_backends(c, device="cpu")


@pytest.mark.parametrize("experts", ["grouped_gemm", "te"])
def test_grouped_backends_refuse_another_hidden_act(monkeypatch, experts):
    # their kernels compute silu(gate) * up: a gelu model would be computed wrongly, silently
    monkeypatch.setitem(backends._DETECTED, "grouped_gemm", True)
    monkeypatch.setitem(backends._DETECTED, "te", True)
    with pytest.raises(BackendUnavailable, match="model.hidden_act='gelu'"):
        check_backends(cfg(**{"backend.experts": experts, "model.hidden_act": "gelu"}), device="cuda")
