"""Text corpora (``data.kind: text`` and ``hf``), tokenised once into cached memory-mapped token files.

``data.path`` for text: a file, a folder (walked recursively for the suffixes in TEXT_SUFFIXES), a glob
(``docs/**/*.md``), or ``stdlib``: the running Python's standard-library modules (the top-level ``*.py`` files,
about 5 MB), a demo corpus on every machine with no download. A file is one document, except JSON lines (one
document per line, its ``data.text_field``) and Parquet (one per row; needs pyarrow). For ``hf``: a dataset
saved with ``save_to_disk`` (a folder), or a hub name where the machine is online; ``data.hf_split`` picks
the split of a hub dataset or a saved DatasetDict.

Documents are joined with the tokenizer's end-of-document id and written to ``train.bin`` (and ``val.bin``)
in a cache folder keyed by the corpus (file paths, sizes, modification times; or the dataset's fingerprint),
the tokenizer and the split, so a second run starts at once. The held-out split is by document: document i
is held out when a hash of i falls below ``data.val_fraction``; ``data.val_path`` names another corpus instead.

    prepared = prepare_corpus(load_config("tiny", ["data.kind=text", "data.path=stdlib"]))
    prepared.train, prepared.val, prepared.tokenizer.name      # token-file paths, and the tokenizer
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from moelab.config import Config, ConfigError
from moelab.config.paths import check_path
from moelab.data.tokenizer import bpe_vocab_size, check_vocab, load_tokenizer

FORMAT = 1  # bump when the cached files' layout changes
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl", ".parquet", ".c", ".h", ".cpp", ".rs", ".go", ".js",
                 ".ts", ".java", ".tex", ".html")
DEMO_CORPORA = {"stdlib": "the running Python's standard-library modules (top-level *.py files)"}


@dataclass
class PreparedCorpus:
    """The cached token files of a corpus: ``train`` (and ``val``, or None), their dtype, and the tokenizer.

        p = prepare_corpus(cfg); np.memmap(p.train, dtype=p.dtype, mode="r")
    """
    train: Path
    val: Path | None
    dtype: str
    tokenizer: object
    folder: Path


def cache_root(cfg: Config) -> Path:
    return Path(cfg.data.cache_dir or os.environ.get("MOELAB_CACHE") or Path.home() / ".cache" / "moelab").expanduser()


def corpus_files(spec: str, field: str = "data.path") -> list[Path]:
    """The files of a text corpus, sorted (their order fixes the documents' order)."""
    if not spec:
        raise ConfigError(f"{field}={spec!r}: give a text file, a folder, a glob, or 'stdlib' (the demo corpus)")
    if spec in DEMO_CORPORA:
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    else:
        path = Path(spec).expanduser()
        if glob.has_magic(spec) and not path.exists():
            files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
        elif check_path(field, path, "file or folder", f"give a text file, a folder, a glob, or one of the demo "
                                                       f"corpora: {', '.join(DEMO_CORPORA)}").is_file():
            files = [path]
        else:  # a folder: its files of the known suffixes (links to devices or FIFOs are not files)
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise ConfigError(f"{field}={spec!r}: the corpus has no files (a folder is searched for "
                          f"{', '.join(TEXT_SUFFIXES)}); point it at text files")
    return files


def file_documents(file: Path, text_field: str, field: str = "data.path") -> Iterator[str]:
    """The documents of one file (see the module docstring); unreadable input is a ConfigError naming the file."""
    try:
        if file.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ConfigError(f"{field}: {file} is Parquet, which needs pyarrow; pip install pyarrow") from None
            table = pq.read_table(file)
            if text_field not in table.column_names:
                raise ConfigError(f"data.text_field={text_field!r}: {file} has no such column; its columns: "
                                  f"{', '.join(table.column_names)}")
            yield from (t for t in table.column(text_field).to_pylist() if t)
            return
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{field}: {file} is not UTF-8 text ({e.reason} at byte {e.start}); remove it or "
                          f"narrow data.path with a glob") from None
    except OSError as e:
        raise ConfigError(f"{field}: {file} cannot be read ({e.strerror}); fix its permissions or leave it "
                          f"out of data.path") from None
    if file.suffix != ".jsonl":
        yield text
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError(f"{field}: {file}:{n} is not valid JSON (JSON lines need one object per line)") \
                from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ConfigError(f"data.text_field={text_field!r}: {file}:{n} has no such string field; set "
                              f"data.text_field to the field holding the text")
        yield record[text_field]


def hf_dataset(cfg: Config, path: str, field: str = "data.path"):
    """A Hugging Face dataset: a folder saved with save_to_disk, else a hub name (online machines only)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.kind='hf' needs the datasets package; pip install datasets (or moelab[data])") \
            from None
    if not path:
        raise ConfigError(f"{field}={path!r}: give a dataset folder (save_to_disk) or a hub dataset name")
    try:
        if Path(path).expanduser().is_dir():
            ds = datasets.load_from_disk(str(Path(path).expanduser()))
        else:
            ds = datasets.load_dataset(path, split=cfg.data.hf_split)
    except Exception as e:  # datasets raises many kinds (FileNotFoundError, DatasetNotFoundError, ConnectionError)
        raise ConfigError(f"{field}={path!r}: cannot load the dataset ({type(e).__name__}: {e}); give a folder "
                          f"saved with Dataset.save_to_disk, or a hub name on a machine that is online") from None
    if isinstance(ds, datasets.DatasetDict):
        if cfg.data.hf_split not in ds:
            raise ConfigError(f"data.hf_split={cfg.data.hf_split!r}: {path} has the splits {', '.join(ds)}")
        ds = ds[cfg.data.hf_split]
    if cfg.data.text_field not in ds.column_names:
        raise ConfigError(f"data.text_field={cfg.data.text_field!r}: {path} has no such column; its columns: "
                          f"{', '.join(ds.column_names)}")
    return ds


class Source:
    """The documents of one corpus, in a fixed order, and a fingerprint that changes when they do.

        src = Source(cfg, "stdlib", "data.path"); src.count, next(src.documents())[:20]
    """

    def __init__(self, cfg: Config, spec: str, field: str):
        self.field = field
        if cfg.data.kind == "hf":
            self.ds = hf_dataset(cfg, spec, field)
            self.count = len(self.ds)
            self.fingerprint = ["hf", spec, cfg.data.hf_split, getattr(self.ds, "_fingerprint", None),
                                self.count]
        else:
            self.ds = None
            self.files = corpus_files(spec, field)
            self.count = len(self.files)
            self.fingerprint = [[str(f.resolve()), *_stat(f)] for f in self.files]
        self.text_field = cfg.data.text_field

    def documents(self, progress=None) -> Iterator[str]:
        if self.ds is not None:
            for i in range(0, self.count, 1000):
                yield from (t for t in self.ds[i:i + 1000][self.text_field] if t)
                if progress is not None:
                    progress.update(min(1000, self.count - i))
            return
        for f in self.files:
            yield from file_documents(f, self.text_field, self.field)
            if progress is not None:
                progress.update(1)


def _stat(f: Path) -> tuple[int, int]:
    st = f.stat()
    return st.st_size, st.st_mtime_ns


def held_out(i: int, fraction: float) -> bool:
    """Whether document i belongs to the validation split: a fixed hash of i, below `fraction`."""
    if fraction <= 0:
        return False
    h = (i + 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9 % 2**64
    h = (h ^ (h >> 31)) * 0x94D049BB133111EB % 2**64
    return (h ^ (h >> 29)) / 2**64 < fraction


def prepare_corpus(cfg: Config, progress: bool = True) -> PreparedCorpus:
    """Tokenise the corpus (and the validation corpus) into the cache unless it is there; every bad input is a
    ConfigError before anything trains. Safe to call from several processes at once (atomic renames)."""
    d = cfg.data
    source = Source(cfg, d.path, "data.path")
    val_source = Source(cfg, d.val_path, "data.val_path") if d.val_path else None
    tok_spec = d.tokenizer if d.tokenizer in ("bytes", "bpe") else str(Path(d.tokenizer).expanduser().resolve())
    corpus_key = _digest([FORMAT, d.kind, source.fingerprint, d.text_field, d.val_fraction])
    root = check_path("data.cache_dir", cache_root(cfg), "folder to write", "set data.cache_dir or $MOELAB_CACHE "
                                                                          "to a writable folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"data.cache_dir={str(root)!r}: cannot be created ({e.strerror}); set data.cache_dir "
                          f"or $MOELAB_CACHE to a writable folder") from None
    train_docs = lambda: (t for i, t in enumerate(source.documents()) if not held_out(i, d.val_fraction))
    bpe_file = root / f"bpe-{corpus_key}-{bpe_vocab_size(cfg)}.json"
    tok = load_tokenizer(cfg, train_docs, bpe_file)
    check_vocab(cfg, tok.vocab_size)
    folder = root / f"corpus-{_digest([corpus_key, tok.key, tok_spec, val_source and val_source.fingerprint])}"
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    meta_file = folder / "meta.json"
    if not meta_file.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        meta = _tokenise(source, val_source, tok, d.val_fraction, folder, dtype, progress)
        meta.update(tokenizer=tok.name, vocab_size=tok.vocab_size, eod_id=tok.eod_id, dtype=dtype,
                    path=d.path, val_path=d.val_path, val_fraction=d.val_fraction)
        _atomic_write(meta_file, json.dumps(meta, indent=1).encode())
    meta = json.loads(meta_file.read_text())
    if meta["train_docs"] == 0:
        raise ConfigError(f"data.path={d.path!r}: the corpus is empty ({source.count} "
                          f"{'rows' if source.ds is not None else 'files'}, no text in them); point it at text")
    if meta["train_tokens"] <= cfg.train.seq_len + 1:
        raise ConfigError(f"data.path={d.path!r}: {meta['train_tokens']} training tokens ({meta['train_docs']} "
                          f"documents), fewer than train.seq_len + 1 = {cfg.train.seq_len + 1}; give more text")
    wants_val = d.val_fraction > 0 or bool(d.val_path)
    if wants_val and meta["val_docs"] == 0:
        name, value = ("data.val_path", d.val_path) if d.val_path else ("data.val_fraction", d.val_fraction)
        raise ConfigError(f"{name}={value!r}: the validation split has no documents (the corpus has "
                          f"{meta['train_docs']}); raise data.val_fraction, or give data.val_path more text")
    if wants_val and meta["val_tokens"] <= cfg.train.seq_len + 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction!r}: the validation split has {meta['val_tokens']} "
                          f"tokens, fewer than train.seq_len + 1 = {cfg.train.seq_len + 1}; hold out more text")
    return PreparedCorpus(folder / "train.bin", folder / "val.bin" if wants_val else None, dtype, tok, folder)


def _tokenise(source: Source, val_source: Source | None, tok, fraction: float, folder: Path, dtype: str,
              progress: bool) -> dict:
    from tqdm.auto import tqdm

    pid = os.getpid()
    writers = {"train": _TokenWriter(folder / "train.bin", dtype, pid, tok.eod_id)}
    if fraction > 0 or val_source is not None:
        writers["val"] = _TokenWriter(folder / "val.bin", dtype, pid, tok.eod_id)
    for src, split in ((source, None), (val_source, "val")):
        if src is None:
            continue
        bar = tqdm(total=src.count, desc=f"tokenising {src.field}", unit="doc" if src.ds is not None else "file",
                   disable=not progress, leave=False)
        batch: list[tuple[str, str]] = []
        for i, text in enumerate(src.documents(bar)):
            if not text.strip():
                continue
            batch.append((split or ("val" if held_out(i, fraction) else "train"), text))
            if len(batch) == 256:
                _write_batch(batch, tok, writers)
                batch = []
        _write_batch(batch, tok, writers)
        bar.close()
    meta = {"train_docs": 0, "train_tokens": 0, "val_docs": 0, "val_tokens": 0}
    for split, w in writers.items():
        meta[f"{split}_docs"], meta[f"{split}_tokens"] = w.close()
    return meta


def _write_batch(batch: list[tuple[str, str]], tok, writers: dict) -> None:
    for (split, _), ids in zip(batch, tok.encode_batch([t for _, t in batch])):
        writers[split].add(ids)


class _TokenWriter:
    """Appends documents (each followed by the end-of-document id) to a temp file; close() renames it."""

    def __init__(self, path: Path, dtype: str, pid: int, eod: int):
        self.path, self.tmp, self.dtype, self.eod = path, path.with_name(f".{path.name}.{pid}.tmp"), dtype, eod
        self.f = open(self.tmp, "wb")
        self.docs = self.tokens = 0

    def add(self, ids: np.ndarray) -> None:
        self.f.write(np.append(ids, self.eod).astype(self.dtype).tobytes())
        self.docs += 1
        self.tokens += len(ids) + 1

    def close(self) -> tuple[int, int]:
        self.f.close()
        self.tmp.replace(self.path)
        return self.docs, self.tokens


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
