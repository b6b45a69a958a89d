"""backend.experts=sonic (moelab.backends.sonic) on CPU: refused where SonicMoE's kernels do not apply, each refusal
naming the field, its value and the fix; a missing package names the install line (preflight, the switchboard and
the call itself); the weights' SonicMoE memory order keeps their values through materialisation."""
import pytest
import torch

import moelab.backends as backends
from moelab.backends import BackendUnavailable, check_backends, check_packages, detected
from moelab.config import ConfigError, load_config
from moelab.model.experts import GroupedExperts


def cfg(**over):
    return load_config("tiny", {"train.steps": 2, "backend.experts": "sonic", **over})


def test_missing_sonic_names_the_install_line_everywhere_it_is_asked_for():
    if detected()["sonic"]:
        pytest.skip("sonic-moe is installed here")
    for ask in (check_packages, lambda c: check_backends(c, device="cuda")):  # preflight, then the ranks
        with pytest.raises(BackendUnavailable) as e:
            ask(cfg())
        msg = str(e.value)
        assert "backend.experts='sonic'" in msg and "'sonic-moe' is not installed" in msg
        assert "pip install --no-deps sonic-moe==0.1.2.post1" in msg and "backend.experts='auto'" in msg
    with pytest.warns(RuntimeWarning, match="falling back to backend.experts='auto'"):
        assert check_backends(cfg(**{"backend.fallback": True}), device="cuda")["experts"] == "auto"
    from moelab.backends.sonic import sonic_experts

    x_TD, w1, w2 = torch.randn(4, 8), torch.randn(2, 8, 12), torch.randn(2, 6, 8)
    with pytest.raises(BackendUnavailable, match="'sonic-moe', which is not installed. Install: pip install --no-deps"):
        sonic_experts(x_TD, torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.long), w1, w2)


@pytest.mark.parametrize("over,capability,match", [
    ({}, None, r"needs a Hopper or newer CUDA GPU \(sm90\+\), and this run is on 'cpu'"),
    ({"model.moe.capacity_factor": 1.25}, None, "every assignment kept.*capacity_factor=1.25"),
    ({"parallel.ep": 2}, None, "every assignment kept.*parallel.ep=2"),
    ({"model.moe.expert_proj_bias": True}, None, "plain SwiGLU experts.*expert_proj_bias=True"),
    ({"model.moe.activation": "gpt_oss"}, None, "plain SwiGLU experts.*activation='gpt_oss'"),
    ({"model.hidden_act": "gelu"}, None, "plain SwiGLU experts.*hidden_act='gelu'"),
    ({"train.dtype": "bfloat16"}, (8, 0), r"needs a Hopper or newer CUDA GPU \(sm90\+\); this GPU is sm80"),
    ({"train.dtype": "float32"}, (9, 0), "its kernels run in bf16; set train.dtype=bfloat16"),
])
def test_sonic_is_refused_where_its_kernels_do_not_apply(monkeypatch, over, capability, match):
    # installed or not, the switchboard's hardware and model checks refuse these (the package check is apart)
    monkeypatch.setitem(backends._DETECTED, "sonic", True)
    device = "cpu"
    if capability is not None:  # a CUDA device of that compute capability, as the switchboard reads it
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
        device = "cuda"
    with pytest.raises(BackendUnavailable, match=f"backend.experts='sonic': .*{match}.*Set backend.experts='auto'"):
        check_backends(cfg(**over), device=device)
    with pytest.warns(RuntimeWarning, match="falling back to backend.experts='auto'"):
        assert check_backends(cfg(**over, **{"backend.fallback": True}), device=device)["experts"] == "auto"


@pytest.mark.parametrize("over,field", [
    ({"train.fp8": "rowwise", "train.dtype": "bfloat16", "train.device": "cuda"}, "train.fp8='rowwise'"),
    ({"train.lora.rank": 4, "train.lora.targets": "experts"}, "backend.experts='sonic'"),
])
def test_sonic_with_fp8_or_expert_lora_is_refused_by_the_config(over, field):
    with pytest.raises(ConfigError, match=field):
        cfg(**over)


def test_sonic_layout_keeps_values_shapes_and_its_memory_order_through_materialisation():
    from moelab.backends.sonic import sonic_layout

    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 8)
    torch.nn.init.normal_(experts.w_gate_up_EDF2)
    torch.nn.init.normal_(experts.w_down_EFD)
    x_ND, counts_E = torch.randn(10, 8), torch.tensor([3, 0, 4, 3])
    want = experts(x_ND, counts_E)
    before = [p.detach().clone() for p in experts.parameters()]
    sonic_layout(experts)
    assert [p.shape for p in experts.parameters()] == [b.shape for b in before]
    assert all(torch.equal(p, b) for p, b in zip(experts.parameters(), before))
    assert experts.w_gate_up_EDF2.transpose(1, 2).is_contiguous()
    assert experts.w_down_EFD.transpose(1, 2).is_contiguous()
    experts.impl = "sonic"  # sorted rows (not on_tokens) keep torch's path, as triton_fused's do
    # the same fp32 GEMMs on transposed storage: only the CPU kernels' summation order differs (16 terms a sum)
    torch.testing.assert_close(experts(x_ND, counts_E), want, rtol=16 * 2**-23, atol=16 * 2**-23 * want.abs().max().item())
    with torch.device("meta"):
        on_meta = GroupedExperts(4, 8, 8, impl="sonic")
    sonic_layout(on_meta)
    built = on_meta.to_empty(device="cpu").to(torch.bfloat16)  # how a run materialises it, then casts
    assert built.w_gate_up_EDF2.transpose(1, 2).is_contiguous() and built.w_down_EFD.transpose(1, 2).is_contiguous()
    built.lora_rank = 2
    with pytest.raises(ValueError, match="backend.experts='sonic' computes plain SwiGLU.*use backend.experts=auto"):
        built.on_tokens(torch.randn(5, 8), torch.ones(5, 2), torch.arange(10), counts_E, torch.zeros(5, 2))


def auto_cfg(**over):
    return load_config("tiny", {"train.steps": 2, "train.dtype": "bfloat16", "train.param_dtype": "bfloat16",
                                **over})


@pytest.mark.parametrize("over,world_size,picks", [
    ({}, 1, "sonic"),  # one rank's experts in bf16: SonicMoE's kernels
    ({"train.param_dtype": "float32"}, 1, "auto"),  # FSDP2 casts them (its gathered copies: moelab's order)
    ({}, 2, "auto"),  # FSDP2 over two ranks
    ({"parallel.ep": 2}, 2, "auto"),  # rows of other ranks
    ({"model.moe.capacity_factor": 1.25}, 1, "auto"),  # drops
    ({"train.fp8": "rowwise", "train.device": "cuda"}, 1, "auto"),  # FP8 experts
    ({"train.lora.rank": 4, "train.lora.targets": "experts"}, 1, "auto"),  # grouped LoRA: torch's path
    ({"train.lora.rank": 4, "train.lora.targets": "attention"}, 1, "sonic"),  # the experts untouched
    ({"model.moe.expert_ffn_size": 96}, 1, "auto"),  # not whole tiles of 64
    ({"train.dtype": "float32", "train.param_dtype": "float32"}, 1, "auto"),  # fp32 compute
])
def test_auto_takes_sonic_where_it_is_installed_and_applies(monkeypatch, over, world_size, picks):
    monkeypatch.setitem(backends._DETECTED, "sonic", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(backends, "import_package", lambda key: object())  # imports: the kernels are here
    c = auto_cfg(**over)
    assert backends.auto_experts(c, "cuda", world_size) == picks
    assert check_backends(c, device="cuda", world_size=world_size)["experts"] == picks
    assert backends.auto_experts(c, "cpu", world_size) == "auto"  # no GPU: never
    monkeypatch.setitem(backends._DETECTED, "sonic", False)
    assert backends.auto_experts(c, "cuda", world_size) == "auto"  # not installed: torch's path, no error


def test_auto_keeps_torch_path_with_a_warning_where_sonic_is_installed_but_broken(monkeypatch):
    monkeypatch.setitem(backends._DETECTED, "sonic", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))

    def broken(key):
        raise BackendUnavailable("the 'sonic' backend's package 'sonic-moe' is installed but failed to import")
    monkeypatch.setattr(backends, "import_package", broken)
    with pytest.warns(RuntimeWarning, match="backend.experts=auto keeps torch's grouped GEMM: .*failed to import"):
        assert check_backends(auto_cfg(), device="cuda")["experts"] == "auto"


def test_the_dispatcher_hands_sonic_the_tokens_weights_and_each_tokens_experts(monkeypatch):
    # SonicMoE's call stood in by the same sum in torch (each token's K experts, weighted): the layer's output and
    # gradients equal torch's path; no dispatch order or counts are computed for it (it builds its own)
    import moelab.backends.sonic as sonic
    from moelab.model.moe import LocalDispatcher

    seen = {}

    def stand_in(x_TD, weights_TK, experts_TK, w1_EDF2, w2_EFD):
        seen.update(sonic_order=w1_EDF2.transpose(1, 2).is_contiguous() and w2_EFD.transpose(1, 2).is_contiguous())
        h_TKF2 = torch.einsum("td,tkdf->tkf", x_TD, w1_EDF2[experts_TK])
        g, u = h_TKF2.chunk(2, dim=-1)
        y_TKD = torch.einsum("tkf,tkfd->tkd", torch.nn.functional.silu(g) * u, w2_EFD[experts_TK])
        return (y_TKD * weights_TK.unsqueeze(-1)).sum(1)

    monkeypatch.setattr(sonic, "sonic_experts", stand_in)
    monkeypatch.setattr(torch, "argsort", lambda *a, **k: pytest.fail("no dispatch order for SonicMoE"))
    torch.manual_seed(0)
    T, K, E, D, F = 12, 2, 4, 8, 12
    ref = GroupedExperts(E, D, F)
    torch.nn.init.normal_(ref.w_gate_up_EDF2)
    torch.nn.init.normal_(ref.w_down_EFD)
    with torch.device("meta"):
        built = GroupedExperts(E, D, F, impl="sonic")
    sonic.sonic_layout(built)
    built = built.to_empty(device="cpu")
    with torch.no_grad():
        built.w_gate_up_EDF2.copy_(ref.w_gate_up_EDF2)
        built.w_down_EFD.copy_(ref.w_down_EFD)
    x_TD = torch.randn(T, D, requires_grad=True)
    weights_TK = torch.rand(T, K, requires_grad=True)
    experts_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    y = LocalDispatcher().route(built, x_TD, weights_TK, experts_TK, None, E)
    assert seen == {"sonic_order": True}
    grads = torch.autograd.grad(y.square().sum(), [x_TD, weights_TK, built.w_gate_up_EDF2, built.w_down_EFD])
    monkeypatch.undo()  # torch's path (sorted rows) for the reference
    want = LocalDispatcher().route(ref, x_TD, weights_TK, experts_TK, None, E)
    wants = torch.autograd.grad(want.square().sum(), [x_TD, weights_TK, ref.w_gate_up_EDF2, ref.w_down_EFD])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, wants):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def sonic_ordered(E=3, D=8, F=4):
    """A GroupedExperts' two parameters in SonicMoE's memory order (sonic_layout)."""
    from moelab.backends.sonic import sonic_layout

    experts = GroupedExperts(E, D, F, impl="sonic")
    sonic_layout(experts)
    return experts.w_gate_up_EDF2, experts.w_down_EFD


def test_weight_grads_go_to_new_tensors_in_sonics_order_on_a_first_micro_batch():
    from moelab.backends.sonic import weight_grad_buffers

    w1, w2 = sonic_ordered()
    dw1, dw2, accumulate = weight_grad_buffers(w1, w2)
    assert not accumulate
    for w, dw in ((w1, dw1), (w2, dw2)):
        assert dw.shape == w.shape and dw.stride() == w.stride() and dw.data_ptr() != w.data_ptr()
    # weights in moelab's order (copied into SonicMoE's each call): new gradients in SonicMoE's order too
    plain = GroupedExperts(3, 8, 4)
    dw1, _, accumulate = weight_grad_buffers(plain.w_gate_up_EDF2, plain.w_down_EFD)
    assert not accumulate and dw1.transpose(1, 2).is_contiguous()


def test_a_later_micro_batch_writes_into_the_weights_own_grad():
    from moelab.backends.sonic import weight_grad_buffers

    w1, w2 = sonic_ordered()
    for w in (w1, w2):
        w.grad = torch.empty_like(w)  # keeps the parameter's strides, as autograd's first accumulation does
    with torch.no_grad():  # as in backward
        dw1, dw2, accumulate = weight_grad_buffers(w1, w2)
    assert accumulate and dw1 is w1.grad and dw2 is w2.grad
    with torch.enable_grad():  # a double backward (create_graph): autograd's accumulation
        assert not weight_grad_buffers(w1, w2)[2]


@pytest.mark.parametrize("why", ["other_strides", "hook", "one_weight", "process_group"])
def test_grads_that_autograd_must_add_are_returned_instead(monkeypatch, why):
    # a gradient in another layout than its weight, a post-accumulate hook (tensor parallelism's, compression's),
    # one of the two weights without a gradient yet, or DDP's reducer: the backward returns fresh gradients
    from moelab.backends.sonic import weight_grad_buffers

    w1, w2 = sonic_ordered()
    w1.grad = torch.zeros(w1.shape) if why == "other_strides" else torch.empty_like(w1)
    if why != "one_weight":
        w2.grad = torch.empty_like(w2)
    if why == "hook":
        w2.register_post_accumulate_grad_hook(lambda p: None)
    if why == "process_group":
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with torch.no_grad():
        dw1, dw2, accumulate = weight_grad_buffers(w1, w2)
    assert not accumulate and dw1 is not w1.grad and dw2 is not w2.grad


def test_the_tile_table_is_what_the_sweeps_measured():
    # moelab.backends.sonic.TILES on sm90, against gallery/scripts/gpu_sonic_tiles.py's records (H100 and H200, the
    # Qwen3 proxy's and DeepSeek-V3's shapes): each entry faster than QuACK's default by the sweep's 2% margin at
    # skewed routing in every sweep, its outputs equal to the default's; the whole layer with the table no slower
    # than with QuACK's defaults (1% for noise) at both routings and both shapes, where a sweep timed it
    import json
    from pathlib import Path

    from moelab.backends.sonic import TILES

    results = Path(__file__).resolve().parents[2] / "gallery/results"
    recs = [json.loads(f.read_text()) for f in sorted(results.glob("*--moelab--sonic-tiles*-issue41-call1*.json"))]
    skewed = [r for r in recs if r.get("routing", "skewed") == "skewed"]
    assert len(skewed) >= 4 and {r["workload"] for r in recs} == {"qwen3-moe-30b-a3b-proxy", "deepseek-v3-proxy"}
    default = json.dumps([128, 192, True, 2, 1, False])
    assert TILES[9]
    for gemm, tile in TILES[9].items():
        for r in skewed:
            timed = r["gemms"][gemm]["ms_by_tile"]
            assert timed[json.dumps(list(tile))] <= 0.98 * timed[default], (gemm, r["variant"])
        for r in recs:
            if gemm in r["gemms"]:
                assert all(m["rel_err_vs_default"] < 1e-2
                           for m in r["gemms"][gemm]["tiles"][json.dumps(list(tile))].values())
    timed_layers = [r for r in recs if r["commit"] == "7781bfb"]  # the sweeps of this table (its commit)
    assert {r["workload"] for r in timed_layers} == {"qwen3-moe-30b-a3b-proxy", "deepseek-v3-proxy"}
    for r in timed_layers:
        for kind in ("skewed", "balanced"):
            ms = {label: x["fwd_bwd_ms"] for label, x in r["layer"][kind].items()}
            assert ms["moelab-table"] <= 1.01 * ms["quack-default"], (r["workload"], kind, ms)


def test_a_tiles_file_replaces_the_tables_entries_and_bad_entries_are_named(tmp_path, monkeypatch):
    import json

    from moelab.backends.sonic import TILES, tiles_for

    f = tmp_path / "tiles.json"
    f.write_text(json.dumps({"down": [256, 128, False, 1, 2, False]}))
    monkeypatch.setenv("MOELAB_SONIC_TILES", str(f))
    assert tiles_for(9) == {**TILES[9], "down": (256, 128, False, 1, 2, False)}
    assert tiles_for(10) == {"down": (256, 128, False, 1, 2, False)}  # no table for sm100: QuACK's defaults
    f.write_text(json.dumps({"gate": [128, 128, True, 1, 1, False]}))
    with pytest.raises(ValueError, match=r"SonicMoE tile gate=\[128, 128, True, 1, 1, False\]: the GEMMs are"):
        tiles_for(9)
    f.write_text(json.dumps({"up": [128, 128]}))
    with pytest.raises(ValueError, match=r"tile up=\[128, 128\].*each tile \('tile_m'"):
        tiles_for(9)


def test_the_backward_gathers_rows_where_the_measurement_found_it_fastest(monkeypatch):
    # moelab.backends.sonic.ROWS_ONCE against gallery/scripts/gpu_sonic_rows.py's records: the whole layer with the
    # GEMMs it names reading rows copied once is the fastest set (1% for noise) at both routings, and every set's
    # gradients equal the all-gathered run's; MOELAB_SONIC_ROWS_ONCE names a set for measurements
    import json
    from pathlib import Path

    from moelab.backends.sonic import ROWS_ONCE, rows_once

    results = Path(__file__).resolve().parents[2] / "gallery/results"
    recs = [json.loads(f.read_text()) for f in sorted(results.glob("*--moelab--sonic-rows*-issue41-call*.json"))]
    assert recs
    sets = {"none": frozenset(), "weight-grads": frozenset({"up_dw", "down_dw"}),
            "all": frozenset({"down_dact", "up_dw", "down_dw"})}
    ours = next(label for label, s in sets.items() if s == ROWS_ONCE)
    for r in recs:
        for kind in ("skewed", "balanced"):
            ms = {label: x["fwd_bwd_ms"] for label, x in r["layer"][kind].items()}
            assert ms[ours] <= 1.01 * min(ms.values()), (kind, ms)
            assert all(e < 1e-2 for x in r["layer"][kind].values() for e in x["rel_err_vs_gathered"].values())
    monkeypatch.delenv("MOELAB_SONIC_ROWS_ONCE", raising=False)
    assert rows_once() == ROWS_ONCE
    monkeypatch.setenv("MOELAB_SONIC_ROWS_ONCE", "up_dw,down_dw")
    assert rows_once() == {"up_dw", "down_dw"}
    monkeypatch.setenv("MOELAB_SONIC_ROWS_ONCE", "up")
    with pytest.raises(ValueError, match="MOELAB_SONIC_ROWS_ONCE=up: the GEMMs that gather rows in backward are"):
        rows_once()


@pytest.mark.parametrize("add_via", ["reduce", "load", "squares"])
@pytest.mark.parametrize("gemm", ["up_dw", "down_dw"])
def test_a_later_micro_batchs_weight_gradient_gemm_adds_into_grad_as_add_via_says(monkeypatch, add_via, gemm):
    # moelab.backends.sonic._dw's calls into QuACK (recorded on CPU): "reduce" adds by QuACK's add-to-output store;
    # "load" hands .grad itself as the C operand (D = A @ B + D), with the gate|up interleave applied to C as to D,
    # and only then may the squares of the final gradient come from the same epilogue; "squares" loads only there
    import moelab.backends.sonic as S
    from moelab.backends import grad_norm, sonic_squares

    calls, squares = [], []
    monkeypatch.setattr(S, "_quack", lambda: (lambda *a, **k: calls.append((a, k)),) * 3)
    monkeypatch.setattr(sonic_squares, "n_tiles", lambda n, device, config=None: 2)

    def gemm_sq(A, B, D, offsets, gather, config, concat, sq_LMT, add=False):
        squares.append((D, concat, add))
        sq_LMT.fill_(1.0)
        return True
    monkeypatch.setattr(sonic_squares, "gemm_sq", gemm_sq)
    monkeypatch.setenv("MOELAB_SONIC_ADD", add_via)
    E, D, F, T = 2, 4, 3, 5
    x_TD, dh_NF2, a_NF = torch.ones(T, D), torch.ones(T, 2 * F), torch.ones(T, F)
    dw1, dw2 = torch.zeros(E, 2 * F, D).transpose(1, 2), torch.zeros(E, D, F).transpose(1, 2)
    w = torch.nn.Parameter(torch.zeros(1))
    run = (lambda sq: S.gemm_up_dw(x_TD, dh_NF2, dw1, None, None, True, None, sq)) if gemm == "up_dw" else \
        (lambda sq: S.gemm_down_dw(x_TD, a_NF, dw2, None, None, True, None, sq))
    run(None)
    (A, B, out, *rest), kw = calls.pop()
    concat = ("out",) if gemm == "up_dw" else None
    if add_via != "load":
        assert rest == [] and kw["add_to_output"] is True and kw["concat_layout"] == concat
    else:
        assert rest[0] is out and not kw.get("add_to_output") and kw["concat_layout"] == (concat and ("out", "C"))
    run(w)  # the step's last micro batch: the norm wants w's squares
    if add_via == "reduce":
        assert not squares and calls, "a reduce store's sum is never in registers: the norm reads the gradient"
    else:
        assert not calls and squares[0][1:] == (concat, True)
        assert grad_norm.param_squared_norms([w]).tolist() == [2.0 * E * D], "the epilogue's sum is the record"
    monkeypatch.setenv("MOELAB_SONIC_ADD", "fused")
    assert S.ADD_VIA in S.ADDS
    with pytest.raises(ValueError, match="MOELAB_SONIC_ADD=fused: the weight-gradient GEMMs add into .grad by"):
        S.add_via()
