"""Per-batch state goes down the forward call (moelab.model.batch_context), not onto modules: a call's token
mask, packed documents and loss scale act on that call only, and compiled blocks take a new BatchContext each
micro batch without recompiling."""
import torch

from moelab.config import load_config
from moelab.model import build_model
from moelab.model.batch_context import BatchContext

B, L = 2, 16


def tiny(*overrides):
    cfg = load_config("tiny", ["model.moe.z_loss_coeff=0.01", *overrides])
    return build_model(cfg).train(), cfg


def router_grads(model, ctx):
    model.zero_grad(set_to_none=True)
    tokens_BL = torch.randint(0, model.cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(0))
    (model(tokens_BL, ctx=ctx) * 0.0).sum().backward()  # only the router losses carry gradient
    return [m.router.weight.grad.clone() for m in model.moe_layers()]


def test_loss_scale_weighs_the_router_losses_of_that_call_only():
    model, _ = tiny()
    full, half = router_grads(model, BatchContext()), router_grads(model, BatchContext(loss_scale=0.5))
    assert all(g.abs().sum() > 0 for g in full)
    for f, h in zip(full, half):
        torch.testing.assert_close(h, 0.5 * f, rtol=0, atol=0)
    again = router_grads(model, None)  # nothing stayed behind on the modules
    for f, a in zip(full, again):
        assert torch.equal(f, a)


def test_mask_and_documents_leave_no_state_behind():
    model, _ = tiny("backend.attention=eager")
    tokens_BL = torch.randint(0, model.cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(1))
    documents_BL = (torch.arange(L) >= L // 2).long().expand(B, L)
    mask_BL = torch.ones(B, L, dtype=torch.bool)
    mask_BL[:, -4:] = False
    with torch.no_grad():
        plain = model(tokens_BL)
        packed = model(tokens_BL, ctx=BatchContext(token_mask_BL=mask_BL, documents_BL=documents_BL))
        after = model(tokens_BL)
    assert not torch.allclose(packed[:, L // 2:], plain[:, L // 2:])  # the second document sees only itself
    torch.testing.assert_close(packed[:, :L // 2], plain[:, :L // 2], rtol=0, atol=1e-5)  # the first: as before
    assert torch.equal(after, plain)
    for m in model.modules():
        assert not hasattr(m, "token_mask") and not hasattr(m, "documents_BL") and not hasattr(m, "loss_scale")


def test_compiled_blocks_take_a_new_context_per_micro_batch_without_recompiling():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    # bf16 grouped GEMMs: the CPU's compiled path without a per-expert loop (whose data-dependent row counts
    # recompile by themselves, whatever the context)
    model, cfg = tiny("model.pad_token_id=0", "backend.experts=grouped_mm")
    model.to(torch.bfloat16)
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.layers.values():
        block.compile(backend=counter)
    for step in range(3):  # fresh masks (other values, same shape) and a fresh context every micro batch
        tokens_BL = torch.randint(0, cfg.model.vocab_size, (B, L), generator=torch.Generator().manual_seed(step))
        mask_BL = tokens_BL != 0
        mask_BL[step % B, : step + 1] = False
        model(tokens_BL, ctx=BatchContext(token_mask_BL=mask_BL, loss_scale=0.25)).sum().backward()
        if step == 0:
            frames = counter.frame_count
    assert frames >= 1 and counter.frame_count == frames  # no recompiles after the first micro batch
    torch._dynamo.reset()
