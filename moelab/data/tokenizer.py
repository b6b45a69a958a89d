"""Tokenizers for text data (``data.tokenizer``): how documents become token ids.

- ``bytes``: the UTF-8 bytes of the text, 256 ids, no dependency; id 0 (the NUL byte, which text does not
  contain) ends each document.
- ``bpe``: a byte-level BPE vocabulary of ``data.bpe_vocab_size`` ids (0 = ``model.vocab_size``) trained on the
  corpus's training documents with the ``tokenizers`` package, once: it is cached beside the tokenised corpus.
- a path: a Hugging Face ``tokenizer.json``, or a folder holding one (its ``tokenizer_config.json`` names the
  end-of-document token where it has an ``eos_token``).

    tok = load_tokenizer(load_config("tiny", ["data.kind=text", "data.path=stdlib"]))
    tok.decode(tok.encode("def f(): pass").tolist())      # 'def f(): pass'
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from moelab.config import Config, ConfigError
from moelab.config.paths import check_path

EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")
BPE_EOD = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as token ids (256 of them); NUL, id 0, ends a document.

        ByteTokenizer().encode("hé").tolist()    # [104, 195, 169]
    """

    name = "bytes"
    vocab_size = 256
    eod_id = 0
    key = "bytes-v1"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.replace("\0", "").encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (a tokenizer.json): a local Hugging Face tokenizer or a trained BPE.

        tok = HFTokenizer("tokenizer.json"); tok.vocab_size, tok.eod_id
    """

    def __init__(self, path: "str | Path", field: str = "data.tokenizer", eod_token: str | None = None):
        from tokenizers import Tokenizer

        path = check_path(field, path, "file or folder", "give 'bytes', 'bpe', a tokenizer.json file or a "
                                                          "folder holding one")
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"{field}={str(path)!r}: no tokenizer.json there; give 'bytes', 'bpe', a "
                              f"tokenizer.json file or a folder holding one")
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust loader raises plain Exceptions
            raise ConfigError(f"{field}={str(path)!r}: not a readable tokenizer.json ({e})") from None
        self.name, self.path = str(path), file
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        eod_token = eod_token or _config_eos(file.parent)
        candidates = ([eod_token] if eod_token else []) + list(EOD_CANDIDATES)
        found = [t for t in candidates if t in vocab]
        if not found:
            raise ConfigError(f"{field}={str(path)!r}: no end-of-document token found (looked for "
                              f"{', '.join(candidates)}); add one of them to the tokenizer")
        self.eod_id = vocab[found[0]]
        import hashlib

        self.key = "hf-" + hashlib.sha256(file.read_bytes()).hexdigest()[:16]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _config_eos(folder: Path) -> str | None:
    try:
        eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def bpe_vocab_size(cfg: Config) -> int:
    return cfg.data.bpe_vocab_size or cfg.model.vocab_size


def check_vocab(cfg: Config, vocab_size: int) -> None:
    """The model must have an embedding row for every id the tokenizer can produce."""
    if vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer!r}: its vocabulary has {vocab_size} ids but "
                          f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size={vocab_size} (or more)")


def train_bpe(documents: Callable[[], Iterable[str]], vocab_size: int, out: Path) -> None:
    """Train a byte-level BPE vocabulary on `documents` and save it as a tokenizer.json at `out` (atomically)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(), trainer=trainer)
    tmp = out.with_name(f".{out.name}.{__import__('os').getpid()}.tmp")
    tok.save(str(tmp))
    tmp.replace(out)


def load_tokenizer(cfg: Config, documents: Callable[[], Iterable[str]] | None = None,
                   cache: Path | None = None):
    """The tokenizer `cfg.data.tokenizer` names, its vocabulary checked against model.vocab_size. "bpe" trains on
    `documents()` into `cache` (a tokenizer.json path) unless that file exists."""
    spec = cfg.data.tokenizer
    if spec == "bytes":
        tok = ByteTokenizer()
    elif spec == "bpe":
        size = bpe_vocab_size(cfg)
        if size < 257:
            raise ConfigError(f"data.bpe_vocab_size={size}: a byte-level BPE needs at least 257 ids (256 bytes "
                              f"and the end-of-document token); raise data.bpe_vocab_size or model.vocab_size, "
                              f"or use data.tokenizer=bytes")
        check_vocab(cfg, size)
        if cache is None or documents is None:
            raise ValueError("load_tokenizer: data.tokenizer='bpe' needs the documents and a cache path")
        if not cache.is_file():
            train_bpe(documents, size, cache)
        tok = HFTokenizer(cache, eod_token=BPE_EOD)
        tok.name = "bpe"
    else:
        tok = HFTokenizer(spec)
    check_vocab(cfg, tok.vocab_size)
    return tok
