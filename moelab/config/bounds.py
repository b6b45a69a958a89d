"""Bounds on a config's sizes, counts, seed and name: what the machine and the dtypes can represent, checked
before the value rules (moelab.config.rules, some of which loop over divisors) and long before a rank starts.

A value past a bound is no run anyone means (`train.global_batch_size: 2**40` would train forever, `seq_len:
2**63` overflows int64, a `name` with '/' or a NUL leaves the runs folder or crashes the file system call); the
ConfigError names the field, the value and the bound.

    check_bounds(load_config("tiny"))                      # passes
    Session("tiny", train={"steps": 1e30})                 # ConfigError: train.steps=1e+30...: at most 2**31-1 ...
"""
from __future__ import annotations

import dataclasses
import re

from moelab.config.rules import _fail, _sections

INT32_MAX = 2**31 - 1   # torch kernels index one dimension, and the step counter is kept, as int32
SEED_LIMIT = 2**62      # seeds derived from train.seed (seed + offsets, numpy's SeedSequence) stay within int64
MAX_TENSOR = 2**36      # elements of one weight (256 GiB in fp32): past any GPU; the largest published are ~2**34
MAX_LAYERS = 2**16
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=,@-]*")
NAME_MAX = 128          # the run folder is <name>-<time>-<id>: well below a file name's 255 bytes


def check_name(name) -> None:
    """config.name: a safe file name (letters, digits and . _ + = , @ -), at most NAME_MAX characters, that
    never leaves the runs folder (no '/', '..' or NUL)."""
    if not isinstance(name, str) or len(name) > NAME_MAX or not NAME.fullmatch(name):
        _fail("name", name, f"must be 1-{NAME_MAX} characters of letters, digits and . _ + = , @ - (starting with "
                            f"a letter or digit): it names the run folder runs/<name>-<time>")


def safe_name(stem: str) -> str:
    """A YAML file's stem as a default name: unsafe characters become '-' (a file 'my run.yaml' is 'my-run')."""
    name = re.sub(r"[^A-Za-z0-9._+=,@-]", "-", stem)[:NAME_MAX].lstrip("._+=,@-")
    return name or "config"


def check_bounds(cfg) -> None:
    """Every bound of the module docstring (ConfigError naming the first field past its bound)."""
    check_name(cfg.name)
    for section, obj in _sections(cfg):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.type in ("int", int) and f.name != "seed" and abs(v) > INT32_MAX:
                _fail(f"{section}.{f.name}", v, "must be at most 2**31-1 (int32: what the kernels index and the "
                                                 "step counter holds)")
    t, m = cfg.train, cfg.model
    if not 0 <= t.seed < SEED_LIMIT:
        _fail("train.seed", t.seed, "must be within [0, 2**62) (the seeds derived from it stay int64)")
    if t.global_batch_size * t.seq_len > INT32_MAX:
        _fail("train.global_batch_size", t.global_batch_size,
              f"times train.seq_len={t.seq_len} gives {t.global_batch_size * t.seq_len} tokens per step; at most "
              f"2**31-1 (the largest published runs train ~2**26 per step): lower one of them")
    if m.num_layers > MAX_LAYERS:
        _fail("model.num_layers", m.num_layers, f"must be at most {MAX_LAYERS}")
    for name, elements in (("model.vocab_size", m.vocab_size * m.hidden_size),
                           ("model.moe.num_experts", m.moe.num_experts * m.hidden_size * m.moe.expert_ffn_size)):
        if elements > MAX_TENSOR:
            _fail(name, getattr(m, "vocab_size") if name == "model.vocab_size" else m.moe.num_experts,
                  f"with model.hidden_size={m.hidden_size} makes a weight of {elements} elements, past 2**36 "
                  f"(256 GiB in fp32, more than any GPU holds; the largest published are ~2**34); lower the sizes")
