"""moelab.backends.loss_kernel (backend.loss=full's in-place kernel) under Triton's CPU interpreter: the loss and the
logits' gradient against torch's cross entropy in fp32 (rows over several blocks, the last one partial; -100 targets;
none counted), the gradient written over the logits, backward rescaling only where its scale differs from the one
forward was told, the logits only read without gradients; and the whole model's loss and gradients equal to the
full loss without the kernel.

The interpreter has to be on before triton is imported, so test_under_the_interpreter runs the other tests in a
subprocess with TRITON_INTERPRET=1; in this process they are skipped."""
import os

import pytest
import torch
import torch.nn.functional as F

from support import pytest_under_interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
inner = pytest.mark.skipif(not INTERPRETED, reason="run by test_under_the_interpreter (TRITON_INTERPRET=1)")
T, V = 6, 150  # rows of 150 logits: blocks of 64 (patched below) leave a partial third block


def test_under_the_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the subprocess")
    pytest_under_interpreter(__file__, 12 + 2 + 2 + 2 + 1 + 1, timeout=600)


def test_the_kernel_does_not_apply_on_cpu_without_the_interpreter(monkeypatch):
    from moelab.backends.loss_kernel import applies

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not applies(torch.zeros(4, 8))  # CPU runs keep torch's loss (the golden losses)


def test_a_config_name_round_trips_and_a_bad_one_is_refused(monkeypatch):
    from moelab.backends import loss_kernel

    for field in ("BLOCK", "WARPS", "ROWS_PER_SM", "EVICT"):  # restored after the test
        monkeypatch.setattr(loss_kernel, field, getattr(loss_kernel, field))
    for name in ("8192x16", "16384x32-rows1-evict", "4096x8-rows4", "32768x32-evict"):
        loss_kernel.set_config(name)
        assert loss_kernel.config_name() == name
    assert (loss_kernel.BLOCK, loss_kernel.WARPS, loss_kernel.ROWS_PER_SM, loss_kernel.EVICT) == (32768, 32, 0, True)
    for bad in ("8192", "1000x16", "8192x16-rows", "8192x16-fast", "8192x16-rows1-rows2"):
        with pytest.raises(ValueError, match=f"loss kernel config '{bad}'.*BLOCKxWARPS"):
            loss_kernel.set_config(bad)


def _case(dtype, masking, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, V, generator=g) * 4).to(dtype)
    t = torch.randint(0, V, (T,), generator=g)
    if masking == "ignore":
        t[1] = t[4] = -100
    elif masking == "none counted":
        t[:] = -100
    return x, t


@inner
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masking", ["all", "ignore", "none counted"])
@pytest.mark.parametrize("expected,got", [(0.25, 0.25), (0.5, 0.3)], ids=["as told", "rescaled"])
def test_loss_and_gradient_equal_torch(monkeypatch, dtype, masking, expected, got):
    from moelab.backends import loss_kernel

    monkeypatch.setattr(loss_kernel, "BLOCK", 64)
    monkeypatch.setattr(loss_kernel, "RESCALE_BLOCK", 16)
    x, t = _case(dtype, masking)
    ref_x = x.float().clone().requires_grad_()
    ref = F.cross_entropy(ref_x, t, ignore_index=-100)
    ref = torch.nan_to_num(ref)  # torch's mean over no counted token is nan; the kernel's is 0
    (ref * got).backward()
    leaf = x.clone().requires_grad_()
    logits = leaf * 1  # a non-leaf, as the head's output is
    assert loss_kernel.applies(logits)
    loss = loss_kernel.cross_entropy_in_place(logits, t, backward_scale=expected)
    assert logits.dtype == dtype and not torch.equal(logits, x)  # the buffer now holds the gradient
    (loss * got).backward()
    assert abs(loss.item() - ref.item()) <= 1e-6 * max(1.0, abs(ref.item()))
    want = ref_x.grad.to(dtype).float()  # torch's gradient in fp32, rounded once to the logits' dtype
    # bf16: two roundings where backward rescales, and the interpreter casts toward zero (the GPU to nearest)
    ulp = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(leaf.grad.float(), want, rtol=ulp, atol=ulp * want.abs().max().item() + 1e-12), \
        (leaf.grad.float() - want).abs().max()
    if masking == "none counted":
        assert not leaf.grad.any()


@inner
@pytest.mark.parametrize("rows_per_sm,evict", [(2, True), (4, False)], ids=["two programs, evict", "four programs"])
def test_programs_walking_rows_give_the_same_loss_and_gradient(monkeypatch, rows_per_sm, evict):
    """ROWS_PER_SM > 0: fewer programs than rows, each walking rows strided by the grid (the interpreter counts
    one SM: 2 or 4 programs over 6 rows, some taking two rows and some one); EVICT's load hints change nothing."""
    from moelab.backends import loss_kernel

    monkeypatch.setattr(loss_kernel, "BLOCK", 64)
    x, t = _case(torch.bfloat16, "ignore", seed=3)
    monkeypatch.setattr(loss_kernel, "ROWS_PER_SM", 0)
    ref_logits = x.clone()
    ref = loss_kernel._row_losses(ref_logits, t, torch.tensor(0.5))
    monkeypatch.setattr(loss_kernel, "ROWS_PER_SM", rows_per_sm)
    monkeypatch.setattr(loss_kernel, "EVICT", evict)
    assert loss_kernel.programs(x) == rows_per_sm < T
    logits = x.clone()
    got = loss_kernel._row_losses(logits, t, torch.tensor(0.5))
    assert torch.equal(got, ref) and torch.equal(logits, ref_logits)  # a row no program walked would keep its logits
    assert not torch.equal(ref_logits, x)  # the reference wrote the gradient


@inner
def test_a_second_backward_through_the_same_graph_is_refused():
    from moelab.backends.loss_kernel import cross_entropy_in_place

    x, t = _case(torch.float32, "all")
    leaf = x.clone().requires_grad_()
    loss = cross_entropy_in_place(leaf * 1, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="gives its gradient once.*retain_graph"):
        loss.backward()


@inner
def test_without_gradients_the_logits_are_only_read():
    from moelab.backends.loss_kernel import cross_entropy_in_place

    x, t = _case(torch.bfloat16, "ignore")
    kept = x.clone()
    with torch.no_grad():
        loss = cross_entropy_in_place(x, t, backward_scale=0.5)
    assert torch.equal(x, kept)
    assert abs(loss.item() - F.cross_entropy(x.float(), t).item()) <= 1e-6 * loss.item()


@inner
@pytest.mark.parametrize("pad", [-1, 3])
def test_the_model_trains_the_same_with_the_kernel(monkeypatch, pad):
    """The tiny model with backend.loss=full: its loss and every gradient with the in-place kernel equal those
    of torch's loss (fp32 model: to 1e-5), micro-batch scale 1/4 as the trainer's backward brings."""
    from moelab.backends import full_loss, loss_kernel
    from moelab.config import load_config
    from moelab.model.batch_context import BatchContext
    from moelab.model.transformer import MoETransformer

    monkeypatch.setattr(loss_kernel, "BLOCK", 64)
    cfg = load_config("tiny", [f"model.pad_token_id={pad}", "backend.loss=full"])
    model = MoETransformer(cfg.model, cfg.backend)
    model.init_weights(seed=1)
    assert model.loss_kind == "full"
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    if pad >= 0:
        tokens[1, 10:] = pad
    calls = []
    monkeypatch.setattr(loss_kernel, "cross_entropy_in_place",
                        lambda *a, _f=loss_kernel.cross_entropy_in_place, **k: calls.append(1) or _f(*a, **k))
    runs = {}
    for in_place in (True, False):
        monkeypatch.setattr(full_loss, "IN_PLACE", in_place)
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], targets_BL=tokens[:, 1:], ctx=BatchContext(loss_scale=0.25))
        (loss * 0.25).backward()
        runs[in_place] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert calls == [1]  # the kernel ran in the first run only
    assert torch.allclose(runs[True][0], runs[False][0], rtol=1e-6)
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, g in runs[False][1].items():
        assert torch.allclose(runs[True][1][name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item()), name
