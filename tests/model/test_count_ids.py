"""Expert counts are taken on the device (moelab.model.router.count_ids), not with torch.bincount, whose output
size comes from idx.max(): a device-to-host read per call on CUDA (24 per micro batch on the Qwen3 proxy) and a
break in the compiled graph. The counts stay bit-identical to bincount's; the dispatcher and the router run on
the meta device (no data: any op that must read values to size its output fails there, as bincount does)."""
import pytest
import torch

from moelab.config import MoEConfig
from moelab.model.moe import LocalDispatcher
from moelab.model.router import Router, count_ids


@pytest.mark.parametrize("n", [1, 5, 129])
def test_counts_equal_bincount(n):
    g = torch.Generator().manual_seed(n)
    idx = torch.randint(n, (1000,), generator=g)
    idx[:3] = 0  # at least one id present; the top ids may be absent (minlength pads them)
    got = count_ids(idx, n + 2)
    ref = torch.bincount(idx, minlength=n + 2)
    assert got.dtype == ref.dtype and torch.equal(got, ref)
    w = (torch.rand(1000, generator=g) < 0.7).float()  # the 0/1 padding weights the router counts with
    assert torch.equal(count_ids(idx, n + 2, w), torch.bincount(idx, w, minlength=n + 2))
    w16 = w.to(torch.bfloat16)
    assert torch.equal(count_ids(idx, n + 2, w16), torch.bincount(idx, w16, minlength=n + 2).float())


def test_bincount_needs_the_data():  # what the meta-device tests below rely on
    with pytest.raises(NotImplementedError):
        torch.bincount(torch.empty(4, dtype=torch.long, device="meta"), minlength=3)


@pytest.mark.parametrize("drop", [False, True])
def test_dispatch_sizes_its_outputs_without_reading_data(drop):
    T, K, D, E = 6, 2, 4, 4
    x = torch.empty(T, D, device="meta")
    experts = torch.empty(T, K, dtype=torch.long, device="meta")
    keep = torch.empty(T, K, dtype=torch.bool, device="meta") if drop else None
    x_ND, counts_E, (order_N, inverse_N) = LocalDispatcher().dispatch(x, experts, keep, E)
    assert x_ND.shape == (T * K, D) and counts_E.shape == (E,) and order_N.shape == inverse_N.shape == (T * K,)


@pytest.mark.parametrize("capacity", [0.0, 1.25])
def test_router_runs_without_reading_data(capacity):
    """Under FakeTensorMode (how torch.compile traces): an op sized by the data (bincount) raises there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=capacity, aux_loss_coeff=0.01)
    with FakeTensorMode():
        r = Router(8, moe).train()
        out = r(torch.randn(2, 3, 8))
        stats = r.pop_stats()
    assert out[0].shape[0] == 6 and stats["tokens_per_expert"].shape == (4,)
