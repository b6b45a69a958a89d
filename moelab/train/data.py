"""Training data. Sample i of step s depends only on (seed, s, i), never on the layout: any number of ranks
sees the same global batch, and a resumed run continues exactly where it stopped.

Each sample is seq_len + 1 token ids (inputs and shifted targets).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moelab.config import Config, ConfigError


class SyntheticData:
    """A fixed random Markov chain over the vocabulary: each token is followed by its successor
    (a random permutation) with probability 1 - noise, else by a uniform token. Learnable, so the loss falls
    from ln(V) towards the chain's entropy."""

    def __init__(self, cfg: Config):
        self.vocab, self.seq_len, self.noise = cfg.model.vocab_size, cfg.train.seq_len, cfg.data.noise
        self.seed = cfg.train.seed
        g = torch.Generator().manual_seed(self.seed + 17)
        self.successor = torch.randperm(self.vocab, generator=g)

    def sample(self, step: int, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(sample_seed(self.seed, step, index))
        n = self.seq_len + 1
        first = torch.randint(self.vocab, (1,), generator=g)
        jumps = torch.rand(n, generator=g) < self.noise
        randoms = torch.randint(self.vocab, (n,), generator=g)
        out = torch.empty(n, dtype=torch.long)
        out[0] = first
        for t in range(1, n):
            out[t] = randoms[t] if jumps[t] else self.successor[out[t - 1]]
        return out


class RandomData:
    """Uniform random tokens (nothing to learn): the mock data of throughput benchmarks, generated vectorised."""

    def __init__(self, cfg: Config):
        self.vocab, self.seq_len, self.seed = cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed

    def sample(self, step: int, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(sample_seed(self.seed, step, index))
        return torch.randint(self.vocab, (self.seq_len + 1,), generator=g)


class TokenFileData:
    """A flat binary file of token ids, memory-mapped; sample windows start at seeded random offsets."""

    def __init__(self, cfg: Config):
        path = Path(cfg.data.path)
        if not path.is_file():
            raise ConfigError(f"data.path={cfg.data.path!r}: no such file (a flat file of "
                              f"{cfg.data.token_dtype} token ids)")
        self.tokens = np.memmap(path, dtype=np.dtype(cfg.data.token_dtype), mode="r")
        self.seq_len, self.seed, self.vocab = cfg.train.seq_len, cfg.train.seed, cfg.model.vocab_size
        if len(self.tokens) <= self.seq_len + 1:
            raise ConfigError(f"data.path={cfg.data.path!r}: {len(self.tokens)} tokens, fewer than "
                              f"train.seq_len + 1 = {self.seq_len + 1}")

    def sample(self, step: int, index: int) -> torch.Tensor:
        rng = np.random.default_rng((self.seed, step, index))
        start = int(rng.integers(0, len(self.tokens) - self.seq_len - 1))
        window = torch.from_numpy(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        if int(window.max()) >= self.vocab:
            raise ValueError(f"data.path: token id {int(window.max())} >= model.vocab_size={self.vocab}")
        return window


def sample_seed(seed: int, step: int, index: int) -> int:
    return (seed * 0x9E3779B1 + step * 0x85EBCA77 + index * 0xC2B2AE3D + 1) % (2**63)


def make_dataset(cfg: Config):
    kinds = {"synthetic": SyntheticData, "random": RandomData, "tokens": TokenFileData}
    return kinds[cfg.data.kind](cfg)


def micro_batch(dataset, step: int, first_index: int, size: int) -> torch.Tensor:
    """Samples first_index .. first_index+size-1 of `step`, stacked to [size, seq_len + 1]."""
    return torch.stack([dataset.sample(step, first_index + i) for i in range(size)])
