"""gallery/scripts/gpu_fp8_blockwise.py on CPU: its blockwise quantisation, the scale layouts it hands torch's
blockwise scaled_mm (torch's own meta checks), its Triton grouped kernel under the interpreter (TRITON_INTERPRET=1,
in a subprocess) against the dequantised reference, and its --small dry run's record."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moelab.gallery import default_root

pytest.importorskip("triton")
SCRIPT = default_root() / "scripts" / "gpu_fp8_blockwise.py"
ROOT = default_root().parent


def _script():
    spec = importlib.util.spec_from_file_location("gpu_fp8_blockwise", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(args, code=None):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_blockwise_quantisation_scales_blocks_and_transposes_bytes_only():
    bw = _script()
    torch.manual_seed(0)
    x = torch.randn(256, 384) * torch.logspace(-3, 3, 384)  # blocks of very different ranges
    x_q, s = bw.quantize_1x128(x)
    assert x_q.dtype == torch.float8_e4m3fn and s.shape == (256, 3) and s.stride() == (1, 256)
    assert torch.equal(torch.log2(s), torch.log2(s).round())  # powers of two
    assert bw.rel(bw.dequant(x_q, s), x) < 0.05
    assert (x_q.float().abs().amax(-1) > 224).all()  # each row's largest block uses e4m3's top binade
    w = torch.randn(3, 256, 384)
    q_ENK, q_EKN, sw = bw.quantize_128x128(w)
    assert sw.shape == (3, 2, 3) and q_ENK.shape == (3, 384, 256) and q_ENK.is_contiguous()
    assert torch.equal(q_ENK.view(torch.uint8), q_EKN.transpose(1, 2).view(torch.uint8))
    assert bw.rel(bw.dequant(q_EKN[1], sw[1]), w[1]) < 0.05


@pytest.mark.parametrize("k", [768, 2048])  # 768: 6 K-blocks, padded to 8 for the 128x128 scales
def test_blockwise_dense_layouts_pass_torch_scaled_mm_checks(k):
    """The operands and scales the script gives F.scaled_mm satisfy torch's own shape/stride checks (its meta
    kernels), for the forward/dgrad (1x128 x 128x128) and the wgrad (1x128 x 1x128) recipes."""
    bw = _script()
    a_q, sa = bw.quantize_1x128(torch.randn(256, k))
    b_q, _, sb = bw.quantize_128x128(torch.randn(1, k, 512))
    meta = lambda *ts: [t.to("meta") for t in ts]
    fn, path = bw.blockwise_mm(*meta(a_q, sa, b_q[0].t(), sb[0]), "128x128", True)
    assert path == "F.scaled_mm" and fn().shape == (256, 512)
    g_q, sg = bw.quantize_1x128(torch.randn(k, 512).t())  # wgrad: both operands along the contracted dim
    assert g_q.is_contiguous()  # row-major from a transposed input too (the GEMM takes its transpose)
    fn, path = bw.blockwise_mm(*meta(a_q, sa, g_q.t(), sg), "1x128", False)
    assert path == "F.scaled_mm" and fn().shape == (256, 512)


KERNEL = textwrap.dedent('''
    import importlib.util, torch
    spec = importlib.util.spec_from_file_location("bw", "gallery/scripts/gpu_fp8_blockwise.py")
    bw = importlib.util.module_from_spec(spec); spec.loader.exec_module(bw)
    torch.manual_seed(0)
    counts = torch.tensor([70, 0, 129, 1, 56])  # an empty expert, rows not a multiple of the tile
    M, K, N = int(counts.sum()), 256, 384
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    w = 0.02 * torch.randn(5, K, N)
    q_ENK, q_EKN, sw = bw.quantize_128x128(w)
    for cfg in ((64, 256, 4, 2), (128, 128, 4, 2)):  # BN 256 > the last column tile: masked
        tiles = {cfg[0]: bw.tile_table(counts, M, cfg[0])}
        for a, b_q, s_b, orient in ((torch.randn(M, K), q_ENK, sw.transpose(1, 2), "fwd"),
                                    (torch.randn(M, N), q_EKN, sw, "dgrad")):
            a_q, sa = bw.quantize_1x128(a)
            out = bw.grouped_fp8_triton(a_q, sa, b_q, s_b, offs, tiles, cfg)
            a_deq, start = bw.dequant(a_q, sa), 0
            ref = torch.empty(out.shape)
            for e, end in enumerate(offs.tolist()):
                ref[start:end] = a_deq[start:end] @ bw.dequant(b_q[e], s_b[e]).t()
                start = end
            # the interpreter truncates fp32 -> bf16 (the GPU rounds): errors of a few 1e-3
            err = bw.rel(out, ref)
            assert err < 1e-2, (cfg, orient, err)
    print("ok")
''')


def test_triton_blockwise_grouped_kernel_matches_dequantised_reference():
    r = _run([], KERNEL)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_small_dry_run_writes_a_record_with_every_variant_and_the_projection(tmp_path):
    r = _run(["--out", str(tmp_path), "--small"])
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "fp8-blockwise-trial.json").read_text())
    assert rec["variant"] == "fp8-blockwise-trial" and rec["commit"] and "--small" in rec["command"]
    assert set(rec["grouped"]) == {"zipf", "even"}
    for split in rec["grouped"].values():
        for name in ("gate_up.fwd", "gate_up.dgrad", "down.fwd", "down.dgrad"):
            v = split[name]
            assert v["bf16"]["rel_err_vs_fp32"] < 1e-2 and v["rowwise"]["rel_err_vs_fp32"] < 0.1
            assert v["triton blockwise"]["rel_err_vs_fp32"] < 0.1, v["triton blockwise"]
            assert v["triton blockwise"]["rel_err_vs_dequantised"] < 1e-2
            assert "error" in v["F.scaled_grouped_mm blockwise"]  # no CPU kernel (nor an SM90 one: see the script)
    proj = rec["projection"]["zipf"]
    bf16 = sum(rec["grouped"]["zipf"][g]["bf16"]["ms"] for g in rec["grouped"]["zipf"] if "." in g)
    assert proj["bf16"]["gemm_ms"] == pytest.approx(bf16)
    trit = proj["blockwise triton grouped (fp8 fwd+dgrad, bf16 wgrad)"]
    assert trit["total_ms"] == pytest.approx(trit["gemm_ms"] + trit["quant_activation_ms"]
                                             + trit["quant_weight_ms_amortised"])
    assert "missing" in proj["blockwise ceiling (cuBLAS dense rates, fp8 wgrad too)"]  # no blockwise GEMM on CPU
