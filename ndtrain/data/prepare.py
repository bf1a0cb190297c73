"""Turn a corpus into a prepared directory of token shards, once, and reuse it.

A prepared directory holds ``tokenizer.json``, ``train-NNNNN.bin``, ``val-NNNNN.bin``
and ``meta.json``. It lives under ``<cache_dir>/data/`` with a name derived from a hash
of every input that determines its content, so a second run with the same inputs costs
a directory lookup, and a changed input (another Python, an edited file, another
vocabulary size) gets a directory of its own.

A prepared directory appears whole or not at all: it is built in a temporary directory
beside its final place and renamed into it. When two processes prepare the same data at
once, the first rename wins and the other process adopts the winner's directory.

The corpus is read in three streaming passes (split plan, tokenizer training,
tokenization), so a corpus larger than memory can be prepared.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ndtrain.data.corpus import STDLIB, is_validation, iter_documents, source_files
from ndtrain.data.loader import TokenStream
from ndtrain.data.shards import DataError, read_shard, write_shard
from ndtrain.data.tokenizer import TextTokenizer

FORMAT = "ndtrain-tokens"
VERSION = 1
SPLITS = ("train", "val")
ENCODE_CHUNK_DOCS = 512  # documents per encode_batch call: enough to keep every thread busy


# ---------------------------------------------------------------------------------------
# Reading a prepared directory


class PreparedData:
    """A checked prepared directory: its metadata, tokenizer and token streams."""

    def __init__(self, path: Path, meta: dict):
        self.path = path
        self.meta = meta
        self.vocab_size: int = meta["vocab_size"]
        self.eot_id: int = meta["eot_id"]
        self.unigram_val_loss: float = meta["unigram_val_loss"]

    @classmethod
    def open(cls, path: str | Path) -> PreparedData:
        path = Path(path).expanduser()
        meta_path = path / "meta.json"
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise DataError(f"prepared data {path}: no meta.json; not a prepared directory") from None
        except (OSError, ValueError) as e:
            raise DataError(f"prepared data {meta_path}: unreadable ({e})") from None
        _check_meta(meta_path, meta)
        return cls(path, meta)

    def tokenizer(self) -> TextTokenizer:
        tok = TextTokenizer.from_file(self.path / "tokenizer.json")
        if tok.eot_id != self.eot_id:
            raise DataError(
                f"prepared data {self.path}: tokenizer.json ends text with id {tok.eot_id} "
                f"but meta.json says {self.eot_id}"
            )
        return tok

    def verify(self) -> None:
        """Every shard matches the checksum in its header and every id lies below the
        vocabulary size, or a DataError names the first shard that breaks it (a flipped byte
        would train silently; an id past the vocabulary would fail with an index error, on
        a rank, in the middle of a run). One pass over the shards' pages."""
        for name in self.meta["train_shards"] + self.meta["val_shards"]:
            tokens = read_shard(self.path / name, verify=True)
            top = int(tokens.max()) if len(tokens) else -1
            if top >= self.vocab_size:
                raise DataError(f"shard {self.path / name}: holds token id {top}, outside the vocabulary "
                                f"of {self.vocab_size} ids that meta.json and tokenizer.json give")

    def stream(self, split: str) -> TokenStream:
        if split not in SPLITS:
            raise DataError(f"split {split!r}: must be one of {', '.join(SPLITS)}")
        stream = TokenStream([self.path / name for name in self.meta[f"{split}_shards"]])
        if len(stream) != self.meta[f"{split}_tokens"]:
            raise DataError(
                f"prepared data {self.path}: {split} shards hold {len(stream)} tokens "
                f"but meta.json says {self.meta[f'{split}_tokens']}"
            )
        return stream


def _check_meta(meta_path: Path, meta: dict) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"prepared data {meta_path}: format is not {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise DataError(f"prepared data {meta_path}: version {meta.get('version')!r}, this reader knows {VERSION}")
    fields = {
        "vocab_size": int, "eot_id": int, "train_tokens": int, "val_tokens": int,
        "train_shards": list, "val_shards": list, "unigram_val_loss": (int, float),
    }
    for name, kind in fields.items():
        if not isinstance(meta.get(name), kind):
            raise DataError(f"prepared data {meta_path}: field {name!r} is missing or not a {kind}")
    for name in meta["train_shards"] + meta["val_shards"]:
        if not isinstance(name, str) or Path(name).name != name:
            raise DataError(f"prepared data {meta_path}: shard name {name!r} is not a plain file name")
        if not (meta_path.parent / name).is_file():
            raise DataError(f"prepared data {meta_path}: listed shard {name} does not exist")
    if not (meta_path.parent / "tokenizer.json").is_file():
        raise DataError(f"prepared data {meta_path.parent}: tokenizer.json is missing")


def _is_prepared_dir(path: Path) -> bool:
    try:
        return json.loads((path / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------
# The cache key


def _source_identity(source: str) -> dict:
    """What makes two reads of ``source`` give the same documents."""
    root, files = source_files(source)
    if source == STDLIB:
        return {
            "stdlib": sys.version.split()[0],
            "files": [[p.relative_to(root).as_posix(), p.stat().st_size] for p in files],
        }
    return {"files": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def _cache_name(source: str, tokenizer: str, vocab_size: int, val_fraction: float,
                jsonl_key: str, shard_tokens: int) -> str:
    if tokenizer:
        tok_path = Path(tokenizer).expanduser()
        try:
            tok_id = hashlib.sha256(tok_path.read_bytes()).hexdigest()
        except OSError as e:
            raise DataError(f"tokenizer {tok_path}: cannot read ({e.strerror})") from None
    else:
        tok_id = f"bpe-{vocab_size}"
    inputs = {
        "format": [FORMAT, VERSION], "source": _source_identity(source), "tokenizer": tok_id,
        "val_fraction": val_fraction, "jsonl_key": jsonl_key, "shard_tokens": shard_tokens,
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    # A readable prefix helps a user find their data in the cache; the hash decides.
    label = STDLIB if source == STDLIB else Path(source).expanduser().resolve().name
    label = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:40] or "data"
    return f"{label}-{digest}"


# ---------------------------------------------------------------------------------------
# The split plan


@dataclass
class SplitPlan:
    """Which documents are held out. A lone document is cut in two instead."""

    val_keys: set[str]
    documents: int
    cut_single: bool
    val_fraction: float

    def assign(self, source: str, jsonl_key: str):
        """Yield ``(split, text)`` for every non-empty document, in corpus order."""
        for key, text in iter_documents(source, jsonl_key):
            if not text:
                continue
            if self.cut_single:
                cut = _cut_point(text, self.val_fraction)
                yield "train", text[:cut]
                yield "val", text[cut:]
            else:
                yield ("val" if key in self.val_keys else "train"), text


def _plan_split(source: str, jsonl_key: str, val_fraction: float) -> SplitPlan:
    """Split by ``is_validation``, then make sure both splits have a document.

    When the hash leaves a split empty, the document nearest to the threshold moves
    across, so the choice is as stable as the hash itself.
    """
    scores, lengths = {}, {}
    for key, text in iter_documents(source, jsonl_key):
        if text:
            scores[key] = zlib.crc32(key.encode("utf-8"))
            lengths[key] = len(text)
    if not scores:
        raise DataError(f"source {source}: no non-empty documents found")
    if len(scores) == 1:
        (length,) = lengths.values()
        if length < 2:
            raise DataError(f"source {source}: a single document of {length} character cannot be split")
        return SplitPlan(set(), 1, True, val_fraction)
    val_keys = {k for k in scores if is_validation(k, val_fraction)}
    if not val_keys:
        val_keys = {min(scores, key=scores.get)}
    elif len(val_keys) == len(scores):
        val_keys.discard(max(scores, key=scores.get))
    return SplitPlan(val_keys, len(scores), False, val_fraction)


def _cut_point(text: str, val_fraction: float) -> int:
    """Where to cut a lone document: at a line start near ``1 - val_fraction`` of it."""
    target = min(max(int(len(text) * (1 - val_fraction)), 1), len(text) - 1)
    newline = text.rfind("\n", 0, target)
    return newline + 1 if newline >= 0 else target


# ---------------------------------------------------------------------------------------
# Writing


class _ShardWriter:
    """Accumulates one split's tokens and writes them in shards of ``shard_tokens``."""

    def __init__(self, directory: Path, split: str, shard_tokens: int, vocab_size: int):
        self.directory, self.split, self.shard_tokens = directory, split, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.names: list[str] = []
        self.total = 0
        self.counts = np.zeros(vocab_size, dtype=np.int64)

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        self.total += len(tokens)
        if self.pending_tokens >= self.shard_tokens:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        buffer = np.concatenate(self.pending) if self.pending else np.empty(0, np.uint32)
        while len(buffer) >= self.shard_tokens or (final and len(buffer)):
            self._write(buffer[: self.shard_tokens])
            buffer = buffer[self.shard_tokens :]
        self.pending, self.pending_tokens = [buffer], len(buffer)

    def _write(self, tokens: np.ndarray) -> None:
        name = f"{self.split}-{len(self.names):05d}.bin"
        write_shard(self.directory / name, tokens)
        self.counts += np.bincount(tokens, minlength=len(self.counts))
        self.names.append(name)

    def close(self) -> None:
        self._flush(final=True)


def unigram_loss(train_counts: np.ndarray, val_counts: np.ndarray) -> float:
    """Cross-entropy (nats/token) of the val tokens under an add-one unigram of the train tokens.

    This is the loss of a model that has learnt token frequencies and nothing else: a
    trained language model that does not beat it has learnt nothing about context.
    """
    log_p = np.log(train_counts + 1.0) - np.log(train_counts.sum() + len(train_counts))
    return float(-(val_counts * log_p).sum() / max(val_counts.sum(), 1))


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("documents"), TimeElapsedColumn(), transient=True, disable=not enabled,
    )


def _build(out: Path, source: str, tokenizer: str, vocab_size: int, val_fraction: float,
           jsonl_key: str, progress: bool, shard_tokens: int) -> None:
    """Write a complete prepared directory into ``out``."""
    plan = _plan_split(source, jsonl_key, val_fraction)
    with _progress(progress) as bar:
        if tokenizer:
            tok = TextTokenizer.from_file(tokenizer)
        else:
            training = bar.add_task("training BPE tokenizer", total=None)
            tok = TextTokenizer.train((t for s, t in plan.assign(source, jsonl_key) if s == "train"), vocab_size)
            bar.remove_task(training)
        tok.save(out / "tokenizer.json")

        writers = {s: _ShardWriter(out, s, shard_tokens, tok.vocab_size) for s in SPLITS}
        total = 2 if plan.cut_single else plan.documents
        task = bar.add_task("tokenizing", total=total)
        chunk: list[tuple[str, str]] = []
        for item in plan.assign(source, jsonl_key):
            chunk.append(item)
            if len(chunk) == ENCODE_CHUNK_DOCS:
                _encode_chunk(tok, chunk, writers)
                bar.advance(task, len(chunk))
                chunk = []
        _encode_chunk(tok, chunk, writers)
        bar.advance(task, len(chunk))
    write_meta(out, tok, writers, source)


def write_meta(out: Path, tok: TextTokenizer, writers: dict, source: str) -> None:
    """Close the splits' writers and write meta.json: the last file of a prepared directory."""
    for w in writers.values():
        w.close()
    meta = {
        "format": FORMAT, "version": VERSION, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
        "train_tokens": writers["train"].total, "val_tokens": writers["val"].total,
        "train_shards": writers["train"].names, "val_shards": writers["val"].names,
        "source": source if source == STDLIB else str(Path(source).expanduser().resolve()),
        "unigram_val_loss": unigram_loss(writers["train"].counts, writers["val"].counts),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def _encode_chunk(tok: TextTokenizer, chunk: list[tuple[str, str]], writers: dict) -> None:
    if not chunk:
        return
    for (split, _), ids in zip(chunk, tok.encode_batch([text for _, text in chunk])):
        ids.append(tok.eot_id)
        writers[split].add(np.asarray(ids, dtype=np.uint32))


# ---------------------------------------------------------------------------------------
# Entry point


def prepare_data(
    source: str = STDLIB,
    tokenizer: str = "",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    cache_dir: str | Path = "~/.cache/ndtrain",
    jsonl_key: str = "text",
    progress: bool = True,
    shard_tokens: int = 1 << 24,
    build_tokens=None,
) -> Path:
    """Return a prepared directory for ``source``, building it only if the cache lacks it.

    ``source`` is ``"stdlib"``, a corpus file or directory, or an already prepared
    directory (returned as is). ``tokenizer`` is a ``tokenizer.json`` to use, or ``""``
    to train a byte-level BPE of ``vocab_size`` on the training documents.
    ``build_tokens``: a source of token files is prepared by it (token_files.prepare_source).
    """
    source = str(source)
    if source != STDLIB and _is_prepared_dir(Path(source).expanduser()):
        return PreparedData.open(source).path
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction}: must lie strictly between 0 and 1")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens {shard_tokens}: must be at least 1")

    if build_tokens is not None and not tokenizer:
        raise DataError(f"source {source}: holds token ids; name the tokenizer that made them (data.tokenizer)")
    name = _cache_name(source, tokenizer, vocab_size, val_fraction, jsonl_key, shard_tokens)
    final = Path(cache_dir).expanduser() / "data" / name
    if final.exists():
        return PreparedData.open(final).path

    final.parent.mkdir(parents=True, exist_ok=True)
    if progress:  # a log (no terminal, no bar) should still say what these seconds are
        what = "the standard library" if source == STDLIB else source
        print(f"preparing {what} once: {'BPE tokenizer, ' if not tokenizer else ''}token shards → {final}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=final.parent))
    try:
        if build_tokens is not None:  # token ids already: split and copied (data/token_files.py)
            build_tokens(tmp, source, tokenizer, val_fraction, shard_tokens)
        else:
            _build(tmp, source, tokenizer, vocab_size, val_fraction, jsonl_key, progress, shard_tokens)
        os.chmod(tmp, 0o755)  # mkdtemp makes the directory private
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            # Another process finished first; its directory has the same content.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData.open(final).path
