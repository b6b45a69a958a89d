"""Training data. Sample i of step s depends only on (seed, s, i), never on the layout: any number of ranks
sees the same global batch, and a resumed run continues exactly where it stopped.

Each sample is seq_len + 1 token ids (inputs and shifted targets).
"""
from __future__ import annotations

import numpy as np
import torch

from moelab.config import Config, ConfigError
from moelab.config.paths import check_path


class GeneratedData:
    """Data drawn from a seeded generator: evaluation batch b is "step" -(b + 1), which no training step draws.

        SyntheticData(cfg).eval_sample(0, 3, 8, 4)     # == .sample(-1, 3)
    """

    def sample(self, step: int, index: int) -> torch.Tensor:
        raise NotImplementedError

    def eval_sample(self, batch: int, index: int, per_batch: int, batches: int) -> torch.Tensor:
        return self.sample(-(batch + 1), index)


class SyntheticData(GeneratedData):
    """A fixed random Markov chain over the vocabulary: each token is followed by its successor
    (a random permutation) with probability 1 - noise, else by a uniform token. Learnable, so the loss falls
    from ln(V) towards the chain's entropy.

        SyntheticData(load_config("tiny")).sample(step=1, index=0).shape     # (65,): seq_len + 1
    """

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


class RandomData(GeneratedData):
    """Uniform random tokens (nothing to learn): the mock data of throughput benchmarks, generated vectorised.

        RandomData(load_config("tiny", ["data.kind=random"])).sample(1, 0)
    """

    def __init__(self, cfg: Config):
        self.vocab, self.seq_len, self.seed = cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed

    def sample(self, step: int, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(sample_seed(self.seed, step, index))
        return torch.randint(self.vocab, (self.seq_len + 1,), generator=g)


class TokenWindows:
    """Windows of seq_len + 1 tokens of a memory-mapped token stream. Training windows start at seeded random
    offsets (sample i of step s depends only on (seed, s, i)); evaluation windows are fixed and evenly spread
    over the stream, so every evaluation sees the same held-out tokens.

        data = TokenWindows(np.arange(1000) % 7, seq_len=16, seed=0); data.sample(1, 0).shape   # (17,)
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed

    def sample(self, step: int, index: int) -> torch.Tensor:
        rng = np.random.default_rng((self.seed, step, index))
        return self._window(int(rng.integers(0, len(self.tokens) - self.seq_len - 1)))

    def eval_sample(self, batch: int, index: int, per_batch: int, batches: int) -> torch.Tensor:
        n = per_batch * batches
        last = len(self.tokens) - self.seq_len - 1
        return self._window((batch * per_batch + index) * last // max(n - 1, 1))

    def _window(self, start: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))


class TokenFileData(TokenWindows):
    """A flat binary file of token ids (data.path, data.token_dtype), memory-mapped; checked whole on open.

        TokenFileData(load_config("tiny", ["data.kind=tokens", "data.path=ids.bin"])).sample(1, 0)
    """

    def __init__(self, cfg: Config, path: str | None = None, field: str = "data.path"):
        path = path or cfg.data.path
        tokens = check_token_file(path, cfg.data.token_dtype, cfg.model.vocab_size, cfg.train.seq_len, field)
        super().__init__(tokens, cfg.train.seq_len, cfg.train.seed)


class TextData(TokenWindows):
    """Text (data.kind 'text' or 'hf') tokenised into the cache (moelab.data.corpus); `split` 'train' or 'val'.

        data = TextData(load_config("tiny", ["data.kind=text", "data.path=stdlib"]))
        data.tokenizer.decode(data.sample(1, 0)[:20].tolist())
    """

    def __init__(self, cfg: Config, split: str = "train", progress: bool = True):
        from moelab.data.corpus import prepare_corpus

        prepared = prepare_corpus(cfg, progress=progress)
        self.tokenizer, self.folder = prepared.tokenizer, prepared.folder
        path = prepared.train if split == "train" else prepared.val
        super().__init__(np.memmap(path, dtype=np.dtype(prepared.dtype), mode="r"), cfg.train.seq_len,
                         cfg.train.seed)


def check_token_file(path: str, dtype: str, vocab: int, seq_len: int, field: str = "data.path") -> np.ndarray:
    """Memory-map a token file after one vectorised scan of all of it: size a whole number of ids, every id
    within [0, vocab). Anything else is a ConfigError naming the field, the value and the fix."""
    file = check_path(field, path, "file", f"give a flat file of {dtype} token ids")
    item = np.dtype(dtype).itemsize
    size = file.stat().st_size
    if size % item:
        raise ConfigError(f"{field}={path!r}: {size} bytes is not a whole number of {dtype} ids ({item} bytes "
                          f"each); check data.token_dtype, or the file is truncated")
    try:
        tokens = np.memmap(file, dtype=np.dtype(dtype), mode="r") if size else np.zeros(0, dtype)
    except OSError as e:
        raise ConfigError(f"{field}={path!r}: cannot be read ({e.strerror})") from None
    if len(tokens) <= seq_len + 1:
        raise ConfigError(f"{field}={path!r}: {len(tokens)} tokens, fewer than train.seq_len + 1 = {seq_len + 1}")
    chunk = 1 << 24
    for lo in range(0, len(tokens), chunk):
        part = tokens[lo:lo + chunk]
        bad_N = (part < 0) | (part >= vocab)
        if bad_N.any():
            at = int(np.argmax(bad_N))
            total = sum(int(((tokens[i:i + chunk] < 0) | (tokens[i:i + chunk] >= vocab)).sum())
                        for i in range(lo, len(tokens), chunk))
            raise ConfigError(f"{field}={path!r}: token id {int(part[at])} at position {lo + at} (and {total - 1} "
                              f"more) is outside [0, model.vocab_size={vocab}); raise model.vocab_size above the "
                              f"largest id ({int(tokens.max())}) or check data.token_dtype")
    return tokens


def sample_seed(seed: int, step: int, index: int) -> int:
    return (seed * 0x9E3779B1 + step * 0x85EBCA77 + index * 0xC2B2AE3D + 1) % (2**63)


def make_dataset(cfg: Config, progress: bool = True):
    """The training data `cfg.data` describes; every bad input is a ConfigError here, before a step runs."""
    if cfg.data.kind in ("text", "hf"):
        return TextData(cfg, progress=progress)
    if cfg.data.kind == "sft":  # chats, loss on the responses: micro batches of their own
        from moelab.data.sft_batches import SFTData

        return SFTData(cfg)
    kinds = {"synthetic": SyntheticData, "random": RandomData, "tokens": TokenFileData}
    return kinds[cfg.data.kind](cfg)


def make_eval_dataset(cfg: Config, train=None, progress: bool = True):
    """The held-out data of train.eval_every: the validation split of a corpus, a validation token file, or
    (synthetic, random) the training generator itself, whose eval_sample draws samples no step draws."""
    d = cfg.data
    if d.kind in ("text", "hf"):
        return TextData(cfg, "val", progress=progress)
    if d.kind == "tokens":
        return TokenFileData(cfg, d.val_path, "data.val_path")
    return train if train is not None else make_dataset(cfg)


def check_data(cfg: Config, progress: bool = True) -> None:
    """Check (and for text, tokenise into the cache) everything the run will read, so that a missing or empty
    corpus, an unreadable file, a tokenizer larger than model.vocab_size, an empty validation split, a token
    file with ids out of range, or train.tensorboard / train.wandb without their package is a ConfigError
    before any process starts."""
    from moelab.loggers.mirror import check_export

    check_export(cfg)
    train = make_dataset(cfg, progress=progress)
    if cfg.train.eval_every or cfg.data.val_path or cfg.data.val_fraction:
        make_eval_dataset(cfg, train, progress=progress)


def micro_batch(dataset, step: int, first_index: int, size: int) -> torch.Tensor:
    """Samples first_index .. first_index+size-1 of `step`, stacked to [size, seq_len + 1]."""
    return torch.stack([dataset.sample(step, first_index + i) for i in range(size)])


def eval_batch(dataset, cfg: Config, batch: int, first_index: int, size: int) -> torch.Tensor:
    """Samples first_index .. first_index+size-1 of evaluation batch `batch` (of train.eval_batches global
    batches), stacked to [size, seq_len + 1]; the same on every layout."""
    G, n = cfg.train.global_batch_size, cfg.train.eval_batches
    return torch.stack([dataset.eval_sample(batch, first_index + i, G, n) for i in range(size)])
