"""Instruction data (``data.kind: sft``): chats rendered with the checkpoint's chat template, loss on the
responses only.

``data.path`` is a JSON lines file; each line is a chat or a prompt/response pair (the pair becomes a user and an
assistant message):

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "...", "response": "..."}

``data.tokenizer`` is a local transformers tokenizer folder (``AutoTokenizer.from_pretrained(path,
local_files_only=True)``; left at its default in a run from ``hf:PATH``, PATH itself when it has tokenizer
files); its chat template renders every record (``data.chat_template``, a jinja file, gives one where it has
none, or replaces it). There is no fallback template: a tokenizer without one is a ConfigError.
Every assistant turn is a response: its tokens, from the end of the generation prompt to the end of the turn
(the end-of-turn token the template writes included), are the targets that count; prompt tokens and padding
get target -100 (IGNORE_INDEX below), which cross_entropy leaves out.

How a token is found to be a response token: the template renders the conversation up to each assistant turn
with ``add_generation_prompt=True`` and through the end of that turn; the characters between the two are the
response, and a token of the whole rendering (a fast tokenizer's offsets) is a response token when it starts in
them. Some templates render a turn differently once later turns follow (Qwen3's writes an empty think block
into the last assistant turn only): there the response runs from where the whole rendering leaves the
generation prompt's rendering to the end of the turn's content in it plus the end-of-turn text the template
writes after the content (as much of it as the whole rendering has there). A turn whose content the whole
rendering does not hold is refused.

Bad input is a ConfigError naming the field, before any step runs (check_data): a missing file, a line that is
not JSON or not a record (its line number), a record without an assistant message or response, an example
longer than ``train.seq_len`` (refused, not truncated: a truncated response would teach an unfinished answer),
no chat template, a tokenizer larger than ``model.vocab_size``. Batching: moelab.data.sft_batches.

    examples = load_examples(load_config("tiny", ["data.kind=sft", "data.path=chats.jsonl",
                                                  "data.tokenizer=my_tokenizer/"]))
    examples[0].ids_N, examples[0].response_N          # token ids, bool: which of them are response tokens
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.config import Config, ConfigError
from moelab.config.paths import check_path
from moelab.config.yaml_io import read_text

IGNORE_INDEX = -100  # targets left out of the loss (transformers' and torch's convention)


@dataclass
class Example:
    """One rendered record: its token ids and which of them are response tokens (loss on those only).

        Example(np.array([5, 6, 7]), np.array([False, False, True])).positions     # 2 input/target pairs
    """
    ids_N: np.ndarray  # int64 [N]
    response_N: np.ndarray  # bool [N]

    @property
    def positions(self) -> int:
        """The input/target pairs it fills in a row: N - 1 (the last token is only a target)."""
        return len(self.ids_N) - 1


def read_records(path: str) -> list[tuple[int, list[dict]]]:
    """(line number, messages) of every non-blank line of a JSON lines file; a ConfigError names a bad line."""
    file = check_path("data.path", path, "file", "data.kind='sft' reads a JSON lines file of {\"messages\": [...]} "
                                                 "or {\"prompt\": ..., \"response\": ...} records")
    records = []
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.path={path!r}: cannot be read as UTF-8 text ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"data.path={path!r}: line {n} is not JSON ({e.msg} at column {e.colno}); fix or "
                              f"remove that line") from None
        records.append((n, _messages(record, f"data.path={path!r}: line {n}")))
    if not records:
        raise ConfigError(f"data.path={path!r}: no records (the file is empty); give a JSON lines file of chats")
    return records


def _messages(record, where: str) -> list[dict]:
    """The chat a record holds: its messages, or a prompt/response pair as a user and an assistant message."""
    fix = 'expected {"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "response": ...}'
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a JSON {type(record).__name__}, not a record; {fix}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ConfigError(f"{where}: 'messages' must be a list of {{\"role\": str, \"content\": str}}; {fix}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{where}: no assistant message, so nothing to train on; add the assistant's "
                              f"answer or remove the line")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if "prompt" in record or "response" in record:
        prompt, response = record.get("prompt"), record.get("response")
        if not isinstance(response, str) or not response:
            raise ConfigError(f"{where}: no response (a non-empty string), so nothing to train on; add it or "
                              f"remove the line")
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}: 'prompt' must be a string; {fix}")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    raise ConfigError(f"{where}: keys {sorted(record)}; {fix}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def chat_tokenizer_path(cfg: Config) -> str:
    """data.tokenizer, or, left at its default ("bytes") in a run from hf:PATH, PATH when it holds tokenizer
    files (a ConfigError naming data.tokenizer when it holds none)."""
    d, base = cfg.data, cfg.train.init_from
    if d.tokenizer != "bytes" or not base.startswith("hf:"):
        return d.tokenizer
    folder = Path(base.removeprefix("hf:"))
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"data.tokenizer={d.tokenizer!r}: data.kind='sft' uses the checkpoint's tokenizer by "
                          f"default, but {folder} (train.init_from) has no tokenizer files "
                          f"({', '.join(TOKENIZER_FILES)}); give data.tokenizer=FOLDER of the model's tokenizer")
    return str(folder)


def load_chat_tokenizer(cfg: Config):
    """The transformers tokenizer of chat_tokenizer_path(cfg) (local files only) with a chat template, or a
    ConfigError."""
    d = cfg.data
    name = chat_tokenizer_path(cfg)
    path = Path(name)
    if not path.is_dir():
        raise ConfigError(f"data.tokenizer={name!r}: not a folder; data.kind='sft' needs a local "
                          f"transformers tokenizer folder (the checkpoint's, or one saved with save_pretrained)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("data.kind='sft': needs transformers; pip install 'moelab[hf]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a folder it cannot read
        raise ConfigError(f"data.tokenizer={name!r}: transformers cannot load a tokenizer from it "
                          f"({type(e).__name__}: {e})") from None
    if not tok.is_fast:
        raise ConfigError(f"data.tokenizer={name!r}: a slow (Python) tokenizer; data.kind='sft' needs a "
                          f"fast one (a tokenizer.json) for its character offsets")
    if d.chat_template:  # a few KB: read as a config file is (a regular file, at most 1 MiB)
        tok.chat_template = read_text(d.chat_template, "data.chat_template", "give a jinja chat template file")
    if not tok.chat_template:
        raise ConfigError(f"data.tokenizer={name!r}: has no chat template, which data.kind='sft' renders "
                          f"chats with; use the checkpoint's tokenizer folder (tokenizer_config.json "
                          f"'chat_template' or chat_template.jinja), or give data.chat_template=FILE.jinja")
    if len(tok) > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer={name!r}: {len(tok)} ids do not fit model.vocab_size="
                          f"{cfg.model.vocab_size}; raise model.vocab_size to at least {len(tok)}")
    return tok


def render(tok, messages: list[dict]) -> Example:
    """Token ids of the chat as the template renders it, and which of them are response tokens (every
    assistant turn; the module docstring says how they are found). ValueError where the whole rendering does
    not hold an assistant turn's content."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tok.apply_chat_template(messages[:i + 1], tokenize=False)
        if through.startswith(before) and text.startswith(through):
            spans.append((len(before), len(through)))
        else:  # the turn renders differently with later turns after it
            spans.append(_turn_in_context(text, before, through, m["content"], i))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids_N = np.asarray(enc["input_ids"], dtype=np.int64)
    starts_N = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    response_N = np.zeros(len(ids_N), dtype=bool)
    for a, b in spans:
        response_N |= (starts_N >= a) & (starts_N < b)
    return Example(ids_N, response_N)


def _turn_in_context(text: str, before: str, through: str, content: str, i: int) -> tuple[int, int]:
    """The characters of assistant turn i in the whole rendering `text`: from where `text` leaves `before` (the
    generation prompt's rendering) through the turn's content and the end-of-turn text `through` writes after
    it (as much of it as `text` has there)."""
    start = len(os.path.commonprefix([text, before]))
    at = text.find(content, start)
    tail_at = through.rfind(content)
    if at < 0 or tail_at < 0:
        raise ValueError(f"the whole chat's rendering does not hold assistant message {i}'s content as written "
                         f"(the template rewrites it), so its tokens cannot be found")
    end = at + len(content)
    suffix = through[tail_at + len(content):]
    return start, end + len(os.path.commonprefix([text[end:end + len(suffix)], suffix]))


def load_examples(cfg: Config, tok=None) -> list[Example]:
    """Every record of data.path rendered and checked: a response token to learn, and within train.seq_len."""
    tok = tok or load_chat_tokenizer(cfg)
    seq_len, path = cfg.train.seq_len, cfg.data.path
    examples = []
    for n, messages in read_records(path):
        try:
            ex = render(tok, messages)
        except Exception as e:  # jinja's TemplateError, a template's raise_exception, the prefix check above
            raise ConfigError(f"data.path={path!r}: line {n}: the chat template of data.tokenizer="
                              f"{chat_tokenizer_path(cfg)!r} cannot render it ({type(e).__name__}: {e}); fix the "
                              f"line, or give a template that renders it (data.chat_template)") from None
        if not ex.response_N[1:].any():
            raise ConfigError(f"data.path={path!r}: line {n}: its responses render to no token to predict; "
                              f"give the assistant's answer or remove the line")
        if ex.positions > seq_len:
            raise ConfigError(f"data.path={path!r}: line {n} is {len(ex.ids_N)} tokens, longer than "
                              f"train.seq_len + 1 = {seq_len + 1} (examples are refused, not truncated); raise "
                              f"train.seq_len to at least {ex.positions} or shorten or remove that record")
        examples.append(ex)
    return examples
