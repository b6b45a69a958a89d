"""Batches of instruction data (``data.kind: sft``): rows, length buckets, packing, micro batches.

Shapes: B rows (micro batch), L positions (the micro batch's length).

- **Rows.** With ``data.sft_packing`` (the default) a row holds several examples, placed first-fit (longest
  first) into ``train.seq_len`` positions; each token attends only within its example (the attention modules'
  document mask: BatchContext.documents_BL, for the sdpa, eager and flex backends) and its rotary
  positions restart at 0, so a packed example gives the logits it gives alone. Without packing a row is one
  example, padded at its end (causal attention keeps the padding out of it).
- **Buckets.** The examples are shuffled once (by train.seed), then sorted by length within chunks of 64 micro
  batches' worth, so a micro batch holds examples of similar length; each micro batch is as long as its longest
  row, rounded up to 16 positions (train.seq_len with train.compile: one shape). Padding is no input to the
  router's statistics or aux loss (its token mask) and gets target -100; prompt tokens are routed and counted
  like any input, but get target -100.
- **Order.** The rows form fixed micro batches of train.micro_batch_size (the last filled up from the first
  rows); every epoch visits all of them in a new seeded order. Global row k (step s, sample i: k = (s-1) x
  global_batch_size + i) depends only on (seed, the data, k), so every layout trains on the same micro
  batches and a resumed run continues exactly (nothing to store in checkpoints beyond the step).

The loss of a step is the mean over micro batches of each one's mean over its response tokens.

    data = SFTData(cfg)
    b = data.micro_batch(step=1, first_index=0, size=2)
    b.inputs_BL, b.targets_BL, b.positions_BL, b.documents_BL, b.valid_BL
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from moelab.config import Config
from moelab.data.transfer import to_device
from moelab.data.sft import IGNORE_INDEX

PAD_MULTIPLE = 16  # a micro batch's length is a multiple of this (fewer distinct shapes), or train.seq_len
BUCKET_MICRO_BATCHES = 64  # examples are sorted by length within chunks of this many micro batches


@dataclass
class SFTBatch:
    """One micro batch: inputs, targets (-100 off the responses), and for packed rows the positions and
    document number of every token (None: plain causal attention from position 0); valid: not padding.

        SFTData(cfg).micro_batch(1, 0, 2).to("cpu").targets_BL
    """
    inputs_BL: torch.Tensor
    targets_BL: torch.Tensor
    valid_BL: torch.Tensor
    positions_BL: torch.Tensor | None = None
    documents_BL: torch.Tensor | None = None

    def to(self, device) -> "SFTBatch":
        return SFTBatch(**{f.name: None if getattr(self, f.name) is None else to_device(getattr(self, f.name), device)
                           for f in fields(self)})


def first_fit(indices: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of examples: each example (in the given order) goes to the first row it fits in."""
    rows, free = [], []
    for i in indices:
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


class SFTData:
    """Instruction data as micro batches (see the module docstring); bad input is a ConfigError when built.

        data = SFTData(load_config("tiny", ["data.kind=sft", "data.path=chats.jsonl", "data.tokenizer=tok/"]))
        data.micro_batch(step=1, first_index=0, size=2).targets_BL
    """

    def __init__(self, cfg: Config):
        from moelab.data.sft import load_chat_tokenizer, load_examples

        self.chat_tokenizer = load_chat_tokenizer(cfg)
        self.examples = load_examples(cfg, self.chat_tokenizer)
        tok = self.chat_tokenizer
        self.pad_id = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
        t = cfg.train
        self.seq_len, self.seed, self.per_micro = t.seq_len, t.seed, t.micro_batch_size
        self.global_batch = t.global_batch_size
        self.pack, self.fixed_length = cfg.data.sft_packing, t.compile
        self.micro_batches = self._micro_batches()
        self._order = (None, None)  # (epoch, its order of the micro batches): the one in use

    def _micro_batches(self) -> list[list[list[int]]]:
        """Micro batches (lists of rows, lists of example indices), built once from the seed."""
        lengths = [ex.positions for ex in self.examples]
        order = np.random.default_rng((self.seed, 0x5F7)).permutation(len(lengths)).tolist()
        chunk, rows = self.per_micro * BUCKET_MICRO_BATCHES, []
        for lo in range(0, len(order), chunk):
            part = sorted(order[lo:lo + chunk], key=lambda i: -lengths[i])  # stable: ties keep the shuffle
            rows += first_fit(part, lengths, self.seq_len) if self.pack else [[i] for i in part]
        rows += [rows[i % len(rows)] for i in range(-len(rows) % self.per_micro)]  # whole micro batches
        return [rows[j:j + self.per_micro] for j in range(0, len(rows), self.per_micro)]

    def row(self, step: int, index: int) -> list[int]:
        """The examples of sample `index` of `step` (>= 1): global row k = (step - 1) x global batch + index."""
        k = (step - 1) * self.global_batch + index
        epoch, j = divmod(k // self.per_micro, len(self.micro_batches))
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng((self.seed, 0x5F8, epoch)).permutation(
                len(self.micro_batches)).tolist())
        return self.micro_batches[self._order[1][j]][k % self.per_micro]

    def micro_batch(self, step: int, first_index: int, size: int) -> SFTBatch:
        """Samples first_index .. first_index+size-1 of `step` as one SFTBatch."""
        rows = [self.row(step, first_index + i) for i in range(size)]
        used = max(sum(self.examples[i].positions for i in row) for row in rows)
        L = self.seq_len if self.fixed_length else min(-(-used // PAD_MULTIPLE) * PAD_MULTIPLE, self.seq_len)
        inputs_BL = np.full((size, L), self.pad_id, dtype=np.int64)
        targets_BL = np.full((size, L), IGNORE_INDEX, dtype=np.int64)
        positions_BL = np.zeros((size, L), dtype=np.int64)
        documents_BL = np.zeros((size, L), dtype=np.int64)
        valid_BL = np.zeros((size, L), dtype=bool)
        for b, row in enumerate(rows):
            at = 0
            for d, i in enumerate(row):
                ex = self.examples[i]
                n = ex.positions
                inputs_BL[b, at:at + n] = ex.ids_N[:-1]
                targets_BL[b, at:at + n] = np.where(ex.response_N[1:], ex.ids_N[1:], IGNORE_INDEX)
                positions_BL[b, at:at + n] = np.arange(n)
                documents_BL[b, at:at + n] = d
                valid_BL[b, at:at + n] = True
                at += n
            # padding is a document of its own: it attends to itself, never to an example (no empty softmax)
            positions_BL[b, at:] = np.arange(L - at)
            documents_BL[b, at:] = len(row)
        packed = {"positions_BL": torch.from_numpy(positions_BL),
                  "documents_BL": torch.from_numpy(documents_BL)} if self.pack else {}
        return SFTBatch(torch.from_numpy(inputs_BL), torch.from_numpy(targets_BL), torch.from_numpy(valid_BL),
                        **packed)
