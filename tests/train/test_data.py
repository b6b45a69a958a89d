"""Training data: the vectorised synthetic chain draws exactly the samples of the per-token loop it replaced;
micro batches reach the device without the host waiting for it."""
import pytest
import torch

from moelab.config import load_config
from moelab.data.batches import SyntheticData, micro_batch, sample_seed
from moelab.data.transfer import to_device


def _loop_sample(data: SyntheticData, step: int, index: int) -> torch.Tensor:
    """The per-token generator moelab used before (the reference)."""
    g = torch.Generator().manual_seed(sample_seed(data.seed, step, index))
    n = data.seq_len + 1
    first = torch.randint(data.vocab, (1,), generator=g)
    jumps = torch.rand(n, generator=g) < data.noise
    randoms = torch.randint(data.vocab, (n,), generator=g)
    out = torch.empty(n, dtype=torch.long)
    out[0] = first
    for t in range(1, n):
        out[t] = randoms[t] if jumps[t] else data.successor[out[t - 1]]
    return out


def test_vectorised_synthetic_samples_equal_the_loop():
    for overrides in (["train.seq_len=64"], ["train.seq_len=300", "data.noise=0.0", "train.seed=3"],
                      ["train.seq_len=40", "data.noise=1.0", "model.vocab_size=7"],
                      ["train.seq_len=128", "data.noise=0.3", "model.vocab_size=1000", "train.seed=11"]):
        data = SyntheticData(load_config("tiny", overrides))
        for step, index in ((1, 0), (1, 5), (17, 3), (400, 0)):
            got, want = data.sample(step, index), _loop_sample(data, step, index)
            assert got.dtype == want.dtype and torch.equal(got, want), (overrides, step, index)


def test_synthetic_samples_follow_the_chain():
    data = SyntheticData(load_config("tiny", ["data.noise=0.0", "train.seq_len=512"]))
    x = data.sample(2, 1)
    assert torch.equal(x[1:], data.successor[x[:-1]])  # no noise: every token is its predecessor's successor


def test_to_device_copies_the_values_off_cuda():
    data = SyntheticData(load_config("tiny", ["train.seq_len=64"]))
    batch_BL = micro_batch(data, 3, 0, 2)
    got = to_device(batch_BL, "cpu")
    assert got.device.type == "cpu" and got.dtype == batch_BL.dtype and torch.equal(got, batch_BL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the copy must not wait for queued kernels")
def test_to_device_does_not_wait_for_queued_kernels():
    """A copy queued behind a long kernel returns at once and still lands after it (a plain pageable copy waits for
    the kernel: gallery/scripts/gpu_check_copy.py times both)."""
    batch_BL = torch.randint(0, 1000, (2, 4097))  # a micro batch of the proxy: 2 x 4,097 token ids
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the current stream
    got = to_device(batch_BL, "cuda")
    assert not torch.cuda.current_stream().query(), "to_device waited for the queued kernel"
    assert torch.equal(got.cpu(), batch_BL)
