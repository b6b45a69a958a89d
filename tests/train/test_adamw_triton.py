"""moelab.train.adamw_triton under Triton's CPU interpreter (TRITON_INTERPRET=1, in a subprocess): the kernel
computes torch's AdamW step (fp32: to rounding; bf16: the same fp32 math, stored rounded as the interpreter
rounds, i.e. truncated; on the GPU Triton rounds to nearest like torch); TritonAdamW keeps torch's groups,
state layout and step hooks (run once), and sends small tensors through torch's own step."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECK = textwrap.dedent('''
    import math
    import torch
    from moelab.train.adamw_triton import TritonAdamW, adamw_update, use_triton_adamw

    torch.manual_seed(0)

    def emulate(p, m, v, g, step, lr, b1, b2, eps, wd, store):
        P, M, V, G = (t.float() for t in (p, m, v, g))
        P = P * (1 - lr * wd)
        M = M + (G - M) * (1 - b1)
        V = V * b2 + G * G * (1 - b2)
        P = P - (lr / (1 - b1 ** step)) * (M / (V.sqrt() / math.sqrt(1 - b2 ** step) + eps))
        return store(P), store(M), store(V)

    def trunc_bf16(x):  # the interpreter's fp32 -> bf16 conversion
        return (x.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

    for dtype, store in ((torch.float32, lambda x: x), (torch.bfloat16, trunc_bf16)):
        p = torch.randn(3000, dtype=dtype)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        pe, me, ve = p.clone(), m.clone(), v.clone()
        step = torch.zeros(())
        for i in range(1, 4):
            g = torch.randn_like(p)
            step += 1
            adamw_update(p, g, m, v, step, 1e-2, 0.9, 0.95, 1e-8, 0.1)
            pe, me, ve = emulate(pe, me, ve, g, i, 1e-2, 0.9, 0.95, 1e-8, 0.1, store)
        for a, b in ((p, pe), (m, me), (v, ve)):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert err < (1e-6 if dtype == torch.float32 else 1e-3), (dtype, err)

    TritonAdamW.DEVICES, TritonAdamW.MIN_NUMEL = ("cpu",), 1000
    # the third: dense, not contiguous (backend.experts=sonic's experts weights, stored transposed)
    big, small, big_t = torch.randn(500, 4), torch.randn(7), torch.randn(4, 300, 5).transpose(1, 2)
    ref = [t.clone().requires_grad_() for t in (big, small, big_t)]
    new = [t.clone().requires_grad_() for t in (big, small, big_t)]
    assert not new[2].is_contiguous() and new[2].stride() == big_t.stride()
    groups = lambda ps: [{"params": [ps[0], ps[2]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]
    o_ref = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.9, 0.95))
    o_new = use_triton_adamw(torch.optim.AdamW(groups(new), lr=1e-2, betas=(0.9, 0.95)))
    calls = []
    o_new.register_step_pre_hook(lambda *a: calls.append("pre"))
    o_new.register_step_post_hook(lambda *a: calls.append("post"))
    for _ in range(3):
        for a, b in zip(ref, new):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        o_ref.step()
        o_new.step()
    for a, b in zip(ref, new):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
        assert b.grad is not None  # the gradients are left as they were
    assert calls == ["pre", "post"] * 3, calls
    s_ref, s_new = o_ref.state[ref[0]], o_new.state[new[0]]
    assert sorted(s_new) == sorted(s_ref) and float(s_new["step"]) == float(s_ref["step"]) == 3
    assert torch.allclose(s_new["exp_avg_sq"], s_ref["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    taken = o_new._kernel_params(o_new.param_groups[0])
    assert [id(p) for p in taken] == [id(new[0]), id(new[2])], "the transposed weight goes through the kernel"
    assert o_new.state[new[2]]["exp_avg"].stride() == big_t.stride()  # its moments laid out as it is
    new[2].grad = new[2].grad.contiguous()  # a gradient in another layout: torch's step takes that tensor
    assert [id(p) for p in o_new._kernel_params(o_new.param_groups[0])] == [id(new[0])]
    print("ok")
''')


def test_triton_adamw_matches_torch_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


MOMENTS = textwrap.dedent('''
    import torch
    from moelab.train.adamw_moments import MomentsAdamW
    from moelab.train.adamw_triton import TritonAdamW, use_triton_adamw

    torch.manual_seed(0)
    TritonAdamW.DEVICES, TritonAdamW.MIN_NUMEL = ("cpu",), 1000
    big, small = torch.randn(500, 4), torch.randn(7)
    ref = [t.clone().requires_grad_() for t in (big, small)]
    new = [t.clone().requires_grad_() for t in (big, small)]
    groups = lambda ps: [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}]
    o_ref = MomentsAdamW(groups(ref), moment_dtype=torch.bfloat16, lr=1e-2, betas=(0.9, 0.95))
    o_new = use_triton_adamw(MomentsAdamW(groups(new), moment_dtype=torch.bfloat16, lr=1e-2, betas=(0.9, 0.95)))
    built = [t.clone().requires_grad_() for t in (big, small)]
    o_built = TritonAdamW(groups(built), moment_dtype=torch.bfloat16, lr=1e-2, betas=(0.9, 0.95), fused=True)
    for _ in range(3):
        for a, b in zip(ref, built):
            b.grad = a.grad = None
        for a, b in zip(new, built):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        o_new.step()
        o_built.step()
    assert all(torch.equal(a, b) for a, b in zip(new, built)), "constructed with moment_dtype = swapped in place"
    assert o_built.state[built[0]]["exp_avg"].dtype == torch.bfloat16
    new = [t.clone().requires_grad_() for t in (big, small)]
    o_new = use_triton_adamw(MomentsAdamW(groups(new), moment_dtype=torch.bfloat16, lr=1e-2, betas=(0.9, 0.95)))
    for _ in range(3):
        for a, b in zip(ref, new):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        o_ref.step()
        o_new.step()
    for a, b in zip(ref, new):
        assert b.dtype == torch.float32
        s = o_new.state[b]
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16, s["exp_avg"].dtype
        # the interpreter truncates fp32 -> bf16 where torch rounds to nearest: the moments differ by bf16 ulps
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-4), (a - b).abs().max()
    assert torch.equal(new[1], ref[1]), "the small tensor takes MomentsAdamW's own step"
    print("ok")
''')


def test_triton_adamw_keeps_bf16_moments_beside_fp32_weights():
    """train.optimizer_state=bf16_moments under TritonAdamW: the kernel stores bf16 moments (reading and updating
    them in fp32) and the tensors it does not take go through MomentsAdamW's step, not torch's."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", MOMENTS], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


CLIP = textwrap.dedent('''
    import torch
    from moelab.train.adamw_triton import TritonAdamW, adamw_update

    torch.manual_seed(0)
    TritonAdamW.DEVICES, TritonAdamW.MIN_NUMEL = ("cpu",), 1000

    def trunc_bf16(x):  # the interpreter's fp32 -> bf16 conversion (Triton on a GPU rounds to nearest, as torch)
        return (x.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

    for dtype in (torch.float32, torch.bfloat16):
        shapes = (torch.randn(500, 4), torch.randn(7), torch.randn(4, 300, 5).transpose(1, 2))  # kernel, torch, kernel
        ref = [t.to(dtype).requires_grad_() for t in shapes]
        new = [t.detach().clone().requires_grad_() for t in ref]
        groups = lambda ps: [{"params": [ps[0], ps[2]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]
        o_ref, o_new = (TritonAdamW(groups(ps), lr=1e-2, betas=(0.9, 0.95)) for ps in (ref, new))
        for i in range(3):
            grads = [torch.empty_like(t).copy_(torch.randn(t.shape) * 4) for t in ref]  # each weight's layout
            coef = torch.clamp(0.5 / (torch.stack([g.float().norm() for g in grads]).norm() + 1e-6), max=1.0)
            assert float(coef) < 1.0  # the step clips
            for a, b, g in zip(ref, new, grads):
                a.grad, b.grad = g.clone(), g.clone()
            # clipping's multiply first: torch's on the tensor torch's step takes; on the kernel's, the multiply of
            # a CUDA gradient by the factor in its dtype (here rounded as the interpreter rounds to bf16)
            for j, a in enumerate(ref):
                a.grad = (a.grad * coef if j == 1 or dtype == torch.float32  # (in the gradient's layout)
                          else torch.empty_like(a.grad).copy_(trunc_bf16(a.grad.float() * coef.to(dtype).float())))
            o_ref.step()
            o_new.clip_in_step(coef)
            o_new.step()
            assert torch.equal(new[1].grad, ref[1].grad), "the gradient torch's step takes: multiplied in place"
            assert torch.equal(new[0].grad, grads[0]), "a kernel's gradient: read scaled, left as it is"
            assert [id(p) for p in o_new._kernel_params(o_new.param_groups[0])] == [id(new[0]), id(new[2])]
        for a, b in zip(ref, new):
            assert torch.equal(a, b), (dtype, (a.float() - b.float()).abs().max())
            assert all(torch.equal(o_ref.state[a][k], o_new.state[b][k]) for k in ("exp_avg", "exp_avg_sq"))
    p = torch.zeros(4, dtype=torch.bfloat16)
    try:
        adamw_update(p, p.clone(), p.clone(), p.clone(), torch.ones(()), 1e-2, 0.9, 0.95, 1e-8, 0.0,
                     scale=torch.tensor(0.5))
        raise AssertionError("an fp32 factor for a bf16 gradient was taken")
    except ValueError as e:
        assert "gradient's dtype" in str(e)
    print("ok")
''')


def test_clipping_multiply_in_the_update_is_bitwise_the_multiply_pass_then_the_step():
    """TritonAdamW.clip_in_step: the kernel reads each large gradient times clipping's factor (the factor in the
    gradient's dtype, the product rounded into it, as torch's multiply of a CUDA gradient stores it) and leaves it
    as it is; the gradients torch's step takes are multiplied in place. Weights and moments bitwise those of the
    multiply and then step(), fp32 and bf16 (the GPU's own check: gallery/scripts/gpu_check_clip.py); a factor
    in another dtype than the gradient's is refused."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", CLIP], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


TRAIN = textwrap.dedent('''
    import sys
    import torch
    from moelab.config import load_config
    from moelab.contract.stream import read_events
    from moelab.train.adamw_triton import TritonAdamW
    from moelab.train.trainer import Trainer

    TritonAdamW.DEVICES, TritonAdamW.MIN_NUMEL = ("cpu",), 2000

    def run(name):
        cfg = load_config("tiny", ["train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=2",
                                   "train.optimizer=adamw_triton", "train.grad_clip=0.05",
                                   "train.save_checkpoints=false"])
        tr = Trainer(cfg, sys.argv[1] + "/" + name)
        tr.run()
        events = [e for e in read_events(sys.argv[1] + "/" + name + "/metrics.jsonl") if e["event"] == "step"]
        return tr, [(e["loss"], e["grad_norm"]) for e in events]

    folded, l_folded = run("folded")
    assert isinstance(folded.optimizer, TritonAdamW)
    assert any(p.numel() >= TritonAdamW.MIN_NUMEL for p in folded.model.parameters()), "the kernel takes some"
    assert all(n > 0.05 for _, n in l_folded), l_folded  # every step clips
    TritonAdamW.clip_in_step = None  # the trainer then multiplies the gradients itself, as before
    plain, l_plain = run("plain")
    assert l_folded == l_plain, (l_folded, l_plain)
    for (name, a), b in zip(plain.model.named_parameters(), folded.model.parameters()):
        assert torch.equal(a, b), name
    print("ok")
''')


def test_the_trainer_hands_clipping_to_the_update_and_trains_exactly_as_with_the_multiply_pass(tmp_path):
    """train.grad_clip > 0 with TritonAdamW: moelab.parallel.place's clip_grad_norm hands its factor to the
    optimizer (no pass over the gradients); a tiny fp32 run's losses, norms and weights are bitwise those of the
    multiply pass (the trainer's path for an optimizer without clip_in_step)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", TRAIN, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
