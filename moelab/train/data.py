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
        # The permutation's cycles, laid end to end in `cycles`: token x sits at cycles[start[x] + pos[x]] in a
        # cycle of length length[x], so its k-th successor is cycles[start[x] + (pos[x] + k) % length[x]].
        succ, seen = self.successor.tolist(), [False] * self.vocab
        cycles, start, pos, length = [], [0] * self.vocab, [0] * self.vocab, [0] * self.vocab
        for x0 in range(self.vocab):
            if seen[x0]:
                continue
            first, members, x = len(cycles), [], x0
            while not seen[x]:
                seen[x] = True
                members.append(x)
                x = succ[x]
            for i, m in enumerate(members):
                start[m], pos[m], length[m] = first, i, len(members)
            cycles += members
        self.cycles, self.start, self.pos, self.length = (torch.tensor(v) for v in (cycles, start, pos, length))

    def sample(self, step: int, index: int) -> torch.Tensor:
        """Vectorised: token t is the (t - j)-th successor of the token drawn at the last jump j <= t (position 0
        counts as a jump to `first`). The draws are those of the per-token loop this replaced, so are the samples."""
        g = torch.Generator().manual_seed(sample_seed(self.seed, step, index))
        n = self.seq_len + 1
        first = torch.randint(self.vocab, (1,), generator=g)
        jumps_N = torch.rand(n, generator=g) < self.noise
        randoms_N = torch.randint(self.vocab, (n,), generator=g)
        jumps_N[0] = True
        randoms_N[0] = first[0]
        t_N = torch.arange(n)
        last_jump_N = torch.cummax(torch.where(jumps_N, t_N, 0), 0).values
        anchor_N = randoms_N[last_jump_N]
        k_N = t_N - last_jump_N
        return self.cycles[self.start[anchor_N] + (self.pos[anchor_N] + k_N) % self.length[anchor_N]]


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
