"""Padding (the router's token mask: BatchContext.token_mask_BL, from the targets that count) is left out of the
aux loss, the z-loss and the routing statistics: the masked router gives what the same router gives on the kept
tokens alone."""
import pytest
import torch

from moelab.config import MoEConfig
from moelab.model.router import Router

D, E = 8, 4


def _router(**moe):
    r = Router(D, MoEConfig(num_experts=E, top_k=2, aux_loss_coeff=1.0, z_loss_coeff=0.1, **moe))
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, D, generator=torch.Generator().manual_seed(0)))
    r.reset_buffers()
    return r.train()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("aux_loss_type", ["batch", "sequence"])
def test_masked_tokens_count_nowhere(aux_loss_type, score_func):
    x_BLD = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(1))
    mask_BL = torch.ones(2, 6, dtype=torch.bool)
    mask_BL[1, 3:] = False  # the second sequence: 3 tokens, then padding
    kw = dict(aux_loss_type=aux_loss_type, score_func=score_func)
    masked = _router(**kw)
    loss = masked(x_BLD, mask_BL)[3]
    stats = masked.pop_stats()
    if aux_loss_type == "batch":  # the 9 kept tokens as one batch
        alone = _router(**kw)
        ref = alone(x_BLD[mask_BL].view(1, 9, D))[3]
        ref_stats = alone.pop_stats()
    else:  # each sequence on its own kept tokens; the aux loss is their mean, the z-loss a token mean
        first, second = _router(**kw), _router(**kw)
        first(x_BLD[:1]), second(x_BLD[1:, :3])
        s1, s2 = first.pop_stats(), second.pop_stats()
        ref = 1.0 * (s1["aux_loss"] + s2["aux_loss"]) / 2 + 0.1 * (6 * s1["z_loss"] + 3 * s2["z_loss"]) / 9
        ref_stats = {"tokens_per_expert": s1["tokens_per_expert"] + s2["tokens_per_expert"]}
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(stats["tokens_per_expert"], ref_stats["tokens_per_expert"])
    assert stats["tokens_per_expert"].sum() == 9 * 2
    unmasked = _router(**kw)
    assert not torch.allclose(unmasked(x_BLD)[3], loss)  # the padding would have counted
