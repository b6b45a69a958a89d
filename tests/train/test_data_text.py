"""Text data: corpora of files, folders, globs and JSON lines; the bytes, trained-BPE and local tokenizers; the
token cache; the split by document; and every bad input refused as a ConfigError naming the field."""
import json

import numpy as np
import pytest
import torch

from moelab.config import ConfigError, load_config
from moelab.data.corpus import corpus_files, held_out, prepare_corpus
from moelab.data.batches import TextData, TokenFileData, check_data, eval_batch, make_dataset, make_eval_dataset
from moelab.data.tokenizer import ByteTokenizer, HFTokenizer

DOCS = {"a.md": "# Routing\nexperts specialise on real text.\n", "b/c.py": "def f(x):\n    return x * 2\n",
        "b/d.txt": "the quick brown fox jumps over the lazy dog\n" * 3, "e.jsonl": None}
LINES = ["first json document", "second json document, a little longer"]


def _corpus(root):
    for name, text in DOCS.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(LINES)))
        else:
            path.write_text(text)
    return root


def _cfg(tmp_path, *overrides, corpus=None):
    corpus = corpus or _corpus(tmp_path / "corpus")
    return load_config("tiny", ["data.kind=text", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                                "train.seq_len=16"] + list(overrides))


def _documents():
    """The corpus's documents in corpus order (files sorted by path; JSON lines one per line)."""
    by_file = {"a.md": [DOCS["a.md"]], "b/c.py": [DOCS["b/c.py"]], "b/d.txt": [DOCS["b/d.txt"]], "e.jsonl": LINES}
    return [d for name in sorted(by_file) for d in by_file[name]]


def test_bytes_tokens_are_the_documents_joined_by_the_end_of_document_id(tmp_path):
    data = TextData(_cfg(tmp_path), progress=False)
    want = b"".join(d.encode() + b"\0" for d in _documents())
    assert bytes(np.asarray(data.tokens, dtype=np.uint8)) == want
    assert data.tokenizer.decode(data.sample(3, 1).tolist()) in want.decode()


def test_the_cache_is_reused_and_rebuilt_when_a_file_changes(tmp_path):
    cfg = _cfg(tmp_path)
    first = prepare_corpus(cfg, progress=False)
    stamp = first.train.stat().st_mtime_ns
    again = prepare_corpus(cfg, progress=False)
    assert again.train == first.train and again.train.stat().st_mtime_ns == stamp  # not tokenised again
    (tmp_path / "corpus" / "a.md").write_text("changed text, longer than before\n")
    changed = prepare_corpus(cfg, progress=False)
    assert changed.folder != first.folder
    assert b"changed text" in changed.train.read_bytes()[::2]  # uint16 ids of ASCII bytes


def test_sampling_is_deterministic_per_step_and_index_whatever_the_object(tmp_path):
    cfg = _cfg(tmp_path)
    a, b = make_dataset(cfg, progress=False), make_dataset(cfg, progress=False)
    assert all(torch.equal(a.sample(s, i), b.sample(s, i)) for s in (1, 2, 9) for i in range(4))
    assert not torch.equal(a.sample(1, 0), a.sample(1, 1))
    assert a.sample(1, 0).shape == (17,)


def test_the_validation_split_holds_out_whole_documents(tmp_path):
    docs = tmp_path / "many"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_text(f"document {i:02d} " * 5)
    cfg = _cfg(tmp_path, "data.val_fraction=0.2", corpus=docs)
    prepared = prepare_corpus(cfg, progress=False)
    split = lambda path: {d for d in bytes(np.fromfile(path, dtype=np.uint16).astype(np.uint8)).decode()
                          .split("\0") if d}
    train, val = split(prepared.train), split(prepared.val)
    held = {f"document {i:02d} " * 5 for i in range(40) if held_out(i, 0.2)}
    assert val == held and train == {f"document {i:02d} " * 5 for i in range(40)} - held
    assert 2 <= len(val) <= 16


def test_bpe_is_trained_once_cached_and_decodes_back(tmp_path):
    cfg = _cfg(tmp_path, "data.tokenizer=bpe", "model.vocab_size=300")
    data = TextData(cfg, progress=False)
    assert data.tokenizer.vocab_size <= 300 and data.tokenizer.path.is_file()
    ids = np.asarray(data.tokens)
    assert ids.max() < 300 and len(ids) < sum(len(d.encode()) for d in _documents())  # merges happened
    text = data.tokenizer.decode(ids.tolist())
    assert all(d in text for d in _documents())
    stamp = data.tokenizer.path.stat().st_mtime_ns
    assert TextData(cfg, progress=False).tokenizer.path.stat().st_mtime_ns == stamp  # not trained again


def test_a_local_tokenizer_folder_is_used_with_its_eos_token(tmp_path):
    trained = TextData(_cfg(tmp_path, "data.tokenizer=bpe", "model.vocab_size=300"), progress=False).tokenizer
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(trained.path.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = HFTokenizer(folder)
    assert tok.eod_id == trained.eod_id and tok.vocab_size == trained.vocab_size
    data = TextData(_cfg(tmp_path, f"data.tokenizer={folder}", "model.vocab_size=300"), progress=False)
    assert np.array_equal(np.asarray(data.tokens), np.asarray(TextData(
        _cfg(tmp_path, "data.tokenizer=bpe", "model.vocab_size=300"), progress=False).tokens))


def test_the_stdlib_demo_corpus_needs_no_download():
    files = corpus_files("stdlib")
    assert len(files) > 50 and all(f.suffix == ".py" for f in files)
    assert ByteTokenizer().encode("é").tolist() == [195, 169]


@pytest.mark.parametrize("overrides, match", [
    (["data.path=/no/such/corpus"], "data.path='/no/such/corpus': no such file or folder"),
    (["data.path=EMPTY"], "the corpus has no files"),
    (["data.path=BLANK"], "the corpus is empty"),
    (["data.path=LATIN1"], "is not UTF-8 text"),
    (["data.path=BADJSON"], "is not valid JSON"),
    (["data.text_field=body"], "data.text_field='body'"),
    (["data.tokenizer=bpe", "data.bpe_vocab_size=1024"], "its vocabulary has 1024 ids but model.vocab_size=256"),
    (["data.tokenizer=/no/tokenizer"], "data.tokenizer='/no/tokenizer': no such file or folder; give 'bytes'"),
    (["data.val_fraction=0.01"], "data.val_fraction=0.01: the validation split has no documents"),
    (["data.val_path=EMPTY"], "data.val_path="),
    (["train.seq_len=100000"], "fewer than train.seq_len"),
])
def test_bad_text_input_is_a_config_error_naming_the_field(tmp_path, overrides, match):
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "x.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    names = {"EMPTY": tmp_path / "empty", "BLANK": tmp_path / "blank", "LATIN1": tmp_path / "latin1.txt",
             "BADJSON": tmp_path / "bad.jsonl"}
    overrides = [o.split("=")[0] + "=" + str(names.get(o.split("=")[1], o.split("=")[1])) for o in overrides]
    cfg = _cfg(tmp_path, *overrides)
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        check_data(cfg, progress=False)


def test_text_fields_are_checked_when_the_config_is_built(tmp_path):
    with pytest.raises(ConfigError, match="data.kind='text' needs data.path"):
        load_config("tiny", ["data.kind=text"])
    with pytest.raises(ConfigError, match="train.eval_every=5: needs a validation split"):
        load_config("tiny", ["data.kind=text", "data.path=stdlib", "train.eval_every=5"])
    with pytest.raises(ConfigError, match="data.val_fraction=1.0: must be within"):
        load_config("tiny", ["data.kind=text", "data.path=stdlib", "data.val_fraction=1.0"])
    with pytest.raises(ConfigError, match="train.eval_every=5: is not supported with pipeline"):
        load_config("tiny", ["train.eval_every=5", "parallel.pp=2"])


@pytest.mark.parametrize("dtype, ids, size_extra, match", [
    ("uint16", [1, 2, 300, 4], 0,
     "token id 300 at position 42 \\(and 0 more\\) is outside \\[0, model.vocab_size=256\\)"),
    ("int32", [1, -5, 3, -1], 0, "token id -5 at position 41 \\(and 1 more\\)"),
    ("uint16", [1, 2, 3, 4], 1, "169 bytes is not a whole number of uint16 ids"),
])
def test_a_token_file_is_scanned_whole_when_opened(tmp_path, dtype, ids, size_extra, match):
    path = tmp_path / "tokens.bin"
    body = np.asarray(list(range(40)) + ids + list(range(40)), dtype=dtype).tobytes() + b"\0" * size_extra
    path.write_bytes(body)
    cfg = load_config("tiny", ["data.kind=tokens", f"data.path={path}", f"data.token_dtype={dtype}",
                               "train.seq_len=16"])
    with pytest.raises(ConfigError, match=f"data.path='{path}': " + match):
        check_data(cfg)


def test_a_good_token_file_reads_windows(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(200, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(path)
    data = TokenFileData(load_config("tiny", ["data.kind=tokens", f"data.path={path}", "train.seq_len=16"]))
    w = data.sample(1, 0)
    assert torch.equal(w[1:] - w[:-1], torch.ones(16, dtype=torch.long))


def test_a_validation_corpus_and_a_validation_token_file(tmp_path):
    val = tmp_path / "val"
    val.mkdir()
    (val / "held.txt").write_text("a held-out document about routing " * 4)
    cfg = _cfg(tmp_path, f"data.val_path={val}", "train.eval_every=2", "train.eval_batches=2")
    check_data(cfg, progress=False)
    held = make_eval_dataset(cfg, progress=False)
    assert bytes(np.asarray(held.tokens, dtype=np.uint8)) == b"a held-out document about routing " * 4 + b"\0"
    train = bytes(np.asarray(make_dataset(cfg, progress=False).tokens, dtype=np.uint8))
    assert b"held-out" not in train  # the validation corpus is not trained on
    ids = tmp_path / "val.bin"
    (np.arange(1000) % 256).astype(np.uint16).tofile(ids)
    cfg = load_config("tiny", ["data.kind=tokens", f"data.path={ids}", f"data.val_path={ids}", "train.seq_len=16",
                               "train.eval_every=1", "train.eval_batches=3"])
    data = make_eval_dataset(cfg)
    G = cfg.train.global_batch_size
    batches = [eval_batch(data, cfg, b, 0, G) for b in range(3)]
    starts = [int(w[0]) for b in batches for w in b]  # ids are positions mod 256: windows spread evenly
    want = [k * (1000 - 17) // (3 * G - 1) % 256 for k in range(3 * G)]
    assert starts == want and torch.equal(eval_batch(data, cfg, 1, 0, G), batches[1])  # fixed, every time
