"""The fused linear + cross-entropy loss (backend.loss=chunked) against the full logits path (backend.loss=full):
loss and gradients of the hidden states, the head weight and a tied embedding within 1e-5 relative, on shapes
where the chunk does not divide the tokens, a chunk is all masked, targets are -100 or the pad id; and the model
and trainer take it."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moelab.backends.loss import lm_loss
from moelab.config import ConfigError, load_config
from moelab.planner.loss import chunk_tokens

B, L, D, V = 3, 13, 24, 37  # T = 39 tokens: chunks of 8 leave 7


def _case(seed=0, tied=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, L, D, generator=g, dtype=torch.float64).float().requires_grad_()
    head = nn.Linear(D, V, bias=False)
    emb = nn.Embedding(V, D)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g) * 0.5)
    if tied:
        head.weight = emb.weight
        with torch.no_grad():
            emb.weight.copy_(torch.randn(V, D, generator=g) * 0.5)
    targets = torch.randint(0, V, (B, L), generator=g)
    return h, head, emb, targets


def _grads(kind, h, head, targets, **kw):
    h = h.detach().clone().requires_grad_()
    head.zero_grad(set_to_none=True)
    loss = lm_loss(h, head, targets, kind, **kw)
    (loss * 0.5).backward()  # a scale other than 1 reaches both gradients
    return loss.detach(), h.grad, head.weight.grad.clone()


def _assert_close(a, b, rel=1e-5):
    assert torch.allclose(a, b, rtol=rel, atol=rel * b.abs().max().item()), (a - b).abs().max()


@pytest.mark.parametrize("chunk", [1, 8, 16, 39, 64])
@pytest.mark.parametrize("masking", ["none", "ignore", "pad", "chunk_masked"])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_equals_full(chunk, masking, tied):
    h, head, emb, targets = _case(tied=tied)
    pad = -1
    if masking == "ignore":  # SFT's prompts
        targets[0, :5] = -100
        targets[2, 7:] = -100
    elif masking == "pad":
        pad = 3
        targets[1, 4:] = pad
    elif masking == "chunk_masked":  # the whole second chunk of 8 (tokens 8..15) left out
        targets.view(-1)[8:16] = -100
    full = _grads("full", h, head, targets, pad_token_id=pad)
    fused = _grads("chunked", h, head, targets, pad_token_id=pad, chunk=chunk)
    for a, b in zip(fused, full):
        _assert_close(a, b)
    if tied:  # the gradient lands on the embedding's parameter: it is the head's weight
        assert emb.weight.grad is not None and torch.equal(emb.weight.grad, fused[2])


def test_all_masked_is_zero_with_zero_gradients():
    h, head, _, targets = _case()
    loss, dh, dw = _grads("chunked", h, head, torch.full_like(targets, -100), chunk=8)
    assert loss.item() == 0.0 and not dh.any() and not dw.any()


def test_no_grad_and_bf16_autocast():
    """Evaluation (no gradients) gives the same loss; under bf16 autocast the head runs in bf16 as nn.Linear
    would, and loss and gradients stay within bf16 rounding of the full path."""
    h, head, _, targets = _case()
    with torch.no_grad():
        _assert_close(lm_loss(h, head, targets, "chunked", chunk=8), lm_loss(h, head, targets, "full"))
    out = []
    for kind in ("full", "chunked"):
        x = h.detach().clone().requires_grad_()
        head.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(x, head, targets, kind, chunk=8)
        loss.backward()
        out.append((loss.detach(), x.grad, head.weight.grad))
    assert out[1][1].dtype == torch.float32 and out[1][2].dtype == torch.float32
    for a, b in zip(out[1], out[0]):
        _assert_close(a, b, rel=2e-2)


def test_refuses_a_head_it_cannot_compute():
    h, _, _, targets = _case()
    with pytest.raises(TypeError, match="backend.loss=full"):
        lm_loss(h, nn.Linear(D, V, bias=True), targets, "chunked")


def test_chunk_tokens():
    assert chunk_tokens(151_936, 8192) == 1024  # fp32 chunk logits within 1 GiB
    assert chunk_tokens(256, 64) == 64  # small vocabularies: the whole micro batch
    assert chunk_tokens(151_936, 8192, setting=3000) == 3000
    assert chunk_tokens(151_936, 100, setting=3000) == 100


def test_model_forward_with_targets_equals_logits_loss():
    """MoETransformer.forward(tokens, targets_BL=...) returns the loss of its own logits, for every kind that runs
    on the CPU, with a tied embedding."""
    from moelab.model import MoETransformer
    from moelab.backends.full_loss import cross_entropy

    cfg = load_config("tiny", ["model.tie_embeddings=true", "backend.loss_chunk_tokens=5"])
    torch.manual_seed(0)
    model = MoETransformer(cfg.model, cfg.backend)
    model.init_weights(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17))
    ref = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], targets_BL=tokens[:, 1:])
    loss.backward()
    _assert_close(loss.detach(), ref.detach())
    for n, g in ref_grads.items():
        _assert_close(dict(model.named_parameters())[n].grad, g)


def test_config_refuses_fp8_head_with_fused_loss():
    with pytest.raises(ConfigError, match="backend.loss=full"):
        load_config("tiny", ["train.fp8=rowwise_lm_head", "train.dtype=bfloat16", "backend.loss=chunked"])
    # auto takes the full loss for the FP8 head (moelab.planner.plan.resolve_loss)
    cfg = load_config("tiny", ["train.fp8=rowwise_lm_head", "train.dtype=bfloat16", "train.device=cuda"])
    from moelab.planner.plan import resolve_loss

    assert resolve_loss(cfg, 1, 80.0) == "full"
    with pytest.raises(ConfigError, match="backend.loss_chunk_tokens"):
        load_config("tiny", ["backend.loss_chunk_tokens=-1"])


def test_liger_and_cce_refused_with_install_hint_on_cpu():
    from moelab.backends import BackendUnavailable, check_backends

    for kind, pip in (("liger", "liger-kernel"), ("cce", "cut-cross-entropy")):
        with pytest.raises(BackendUnavailable, match=f"backend.loss='{kind}'.*(install|CUDA GPU)"):
            check_backends(load_config("tiny", [f"backend.loss={kind}"]), device="cpu")
        with pytest.warns(RuntimeWarning, match="falling back"):
            assert check_backends(load_config("tiny", [f"backend.loss={kind}", "backend.fallback=true"]),
                                  device="cpu")["loss"] == "chunked"
