"""Building a prepared directory: the split plan, the tokenizer, the token shards, and the
progress that lets an interrupted build continue where it stopped.

The corpus is read in streaming passes (the split plan; the tokenizer's training when none
is given; the tokenization), each holding one document at a time in the reading process and
a bounded number of chunks in the workers (data/encode.py), so a corpus larger than memory
can be prepared.

While it tokenizes, the build records its progress in the directory it builds in, after each
shard it writes: how many documents of the stream are in the shards, the shards' names, and
each split's tokens not yet in a shard with its token counts (`progress.json` and the `.npy`
files of its generation; the JSON is replaced last, so a crash at any moment leaves a
consistent record). A build started again on the same directory skips the recorded
documents (read, not tokenized) and carries on; its shards are those an uninterrupted build
writes, byte for byte.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ndtrain.data.corpus import STDLIB, is_validation, iter_document_sizes, iter_documents
from ndtrain.data.encode import ChunkEncoder, encode_stream
from ndtrain.data.shards import DataError, write_shard
from ndtrain.data.tokenizer import TextTokenizer

FORMAT = "ndtrain-tokens"
VERSION = 1
SPLITS = ("train", "val")
PROGRESS = "progress.json"


def source_label(source: str) -> str:
    """The source as meta.json records it: "stdlib", or the corpus's absolute path."""
    return source if source == STDLIB else str(Path(source).expanduser().resolve())


# ---------------------------------------------------------------------------------------
# The split plan


@dataclass
class BadRecords:
    """Malformed records skipped (data.on_bad_record = skip): how many, and the first few."""

    count: int = 0
    first: list[str] = field(default_factory=list)

    def __call__(self, problem: str) -> None:
        self.count += 1
        if len(self.first) < 3:
            self.first.append(problem)


@dataclass
class SplitPlan:
    """Which documents are held out: those `is_validation` picks, except that a split the hash
    leaves empty gets the document nearest the threshold (`force_val` / `force_train`); a lone
    document is cut in two instead. Also what the first pass counted."""

    documents: int
    cut_single: bool
    val_fraction: float
    force_val: str | None = None
    force_train: str | None = None
    bad: BadRecords = field(default_factory=lambda: BadRecords())

    def is_val(self, key: str) -> bool:
        if key == self.force_val or key == self.force_train:
            return key == self.force_val
        return is_validation(key, self.val_fraction)

    def assign(self, source: str, text_key: str, skip_bad: bool):
        """Yield ``(is_validation, text)`` for every non-empty document, in corpus order."""
        bad = (lambda problem: None) if skip_bad else None
        for key, text in iter_documents(source, text_key, bad):
            if not text:
                continue
            if self.cut_single:
                cut = _cut_point(text, self.val_fraction)
                yield False, text[:cut]
                yield True, text[cut:]
            else:
                yield self.is_val(key), text


def plan_split(source: str, text_key: str, val_fraction: float, skip_bad: bool) -> SplitPlan:
    """One pass over the corpus's document keys, holding only counts and the two extreme
    hashes; whole-file documents are not read (`iter_document_sizes`).

    When the hash leaves a split empty, the document nearest to the threshold moves across
    (the first of equals in corpus order), so the choice is as stable as the hash itself.
    A malformed record stops here (data.on_bad_record = error), or is counted and skipped.
    """
    bad = BadRecords()
    count = n_val = 0
    lo = hi = None  # (crc32, key) of the lowest and highest hash
    for key, size in iter_document_sizes(source, text_key, bad if skip_bad else None):
        if not size:
            continue
        count += 1
        score = zlib.crc32(key.encode("utf-8"))
        n_val += is_validation(key, val_fraction)
        if lo is None or score < lo[0]:
            lo = (score, key)
        if hi is None or score > hi[0]:
            hi = (score, key)
    if not count:
        raise DataError(f"source {source}: no non-empty documents found")
    plan = SplitPlan(count, count == 1, val_fraction, bad=bad)
    if count == 1:
        length = len(next(text for _, text in iter_documents(source, text_key, lambda problem: None) if text))
        if length < 2:
            raise DataError(f"source {source}: a single document of {length} character cannot be split")
    elif n_val == 0:
        plan.force_val = lo[1]
    elif n_val == count:
        plan.force_train = hi[1]
    return plan


def _cut_point(text: str, val_fraction: float) -> int:
    """Where to cut a lone document: at a line start near ``1 - val_fraction`` of it."""
    target = min(max(int(len(text) * (1 - val_fraction)), 1), len(text) - 1)
    newline = text.rfind("\n", 0, target)
    return newline + 1 if newline >= 0 else target


# ---------------------------------------------------------------------------------------
# Writing


class ShardWriter:
    """Accumulates one split's tokens and writes them in shards of ``shard_tokens``."""

    def __init__(self, directory: Path, split: str, shard_tokens: int, vocab_size: int):
        self.directory, self.split, self.shard_tokens = directory, split, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.names: list[str] = []
        self.total = 0
        self.counts = np.zeros(vocab_size, dtype=np.int64)

    def add(self, tokens: np.ndarray) -> bool:
        """Queue `tokens`; True when a shard was written."""
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        self.total += len(tokens)
        if self.pending_tokens >= self.shard_tokens:
            self._flush(final=False)
            return True
        return False

    def buffer(self) -> np.ndarray:
        return np.concatenate(self.pending) if self.pending else np.empty(0, np.uint32)

    def _flush(self, final: bool) -> None:
        buffer = self.buffer()
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


# ---------------------------------------------------------------------------------------
# Progress on disk


def save_progress(out: Path, documents: int, writers: dict[str, ShardWriter], generation: int) -> None:
    """Record that the first `documents` documents are in `writers` (shards and buffers)."""
    for split, w in writers.items():
        np.save(out / f"pending-{split}-{generation}.npy", w.buffer())
        np.save(out / f"counts-{split}-{generation}.npy", w.counts)
    record = {"documents": documents, "generation": generation,
              "splits": {s: {"names": w.names, "total": w.total} for s, w in writers.items()}}
    tmp = out / f".{PROGRESS}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / PROGRESS)
    for old in out.glob("*.npy"):
        if not old.stem.endswith(f"-{generation}"):
            old.unlink()


def load_progress(out: Path, writers: dict[str, ShardWriter]) -> tuple[int, int]:
    """Restore `writers` from a recorded progress; (documents done, generation), (0, 0) if none."""
    try:
        record = json.loads((out / PROGRESS).read_text())
        generation = record["generation"]
        for split, w in writers.items():
            pending = np.load(out / f"pending-{split}-{generation}.npy")
            counts = np.load(out / f"counts-{split}-{generation}.npy")
            if len(counts) != len(w.counts):
                return 0, 0
            w.names, w.total = list(record["splits"][split]["names"]), record["splits"][split]["total"]
            w.pending, w.pending_tokens, w.counts = [pending], len(pending), counts
        return record["documents"], generation
    except (OSError, ValueError, KeyError, TypeError):
        return 0, 0


# ---------------------------------------------------------------------------------------
# The build


@dataclass
class BuildSettings:
    source: str
    tokenizer: str  # "" = train a BPE of vocab_size; a tokenizer.json; hf:DIR
    vocab_size: int
    val_fraction: float
    text_key: str
    shard_tokens: int
    workers: int  # processes that tokenize (1: this one)
    skip_bad: bool  # data.on_bad_record = skip
    progress: bool


def _bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("documents"),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), transient=True, disable=not enabled,
    )


def _tokenizer(s: BuildSettings, plan: SplitPlan, out: Path, bar: Progress) -> TextTokenizer:
    """The build's tokenizer: the one given, or the BPE trained on the training documents
    (kept in `out`, so a resumed build does not train it again)."""
    if s.tokenizer:
        return TextTokenizer.load(s.tokenizer)
    if (out / "tokenizer.json").is_file():
        return TextTokenizer.from_file(out / "tokenizer.json")
    training = bar.add_task("training BPE tokenizer", total=None, rate="")
    tok = TextTokenizer.train((t for v, t in plan.assign(s.source, s.text_key, s.skip_bad) if not v), s.vocab_size)
    bar.remove_task(training)
    tok.save(out / "tokenizer.json")
    return tok


def build(out: Path, s: BuildSettings) -> dict:
    """Write a complete prepared directory into `out` (continuing a recorded progress there);
    returns what the build did (documents, bytes, tokens, seconds, workers, bad records)."""
    plan = plan_split(s.source, s.text_key, s.val_fraction, s.skip_bad)
    with _bar(s.progress) as bar:
        tok = _tokenizer(s, plan, out, bar)
        tok.save(out / "tokenizer.json")
        writers = {split: ShardWriter(out, split, s.shard_tokens, tok.vocab_size) for split in SPLITS}
        done, generation = load_progress(out, writers)
        total = 2 if plan.cut_single else plan.documents
        if done and s.progress:
            print(f"continuing an interrupted prepare at document {done:,} of {total:,}", flush=True)
        task = bar.add_task("tokenizing", total=total, completed=done, rate="")
        stream = (item for i, item in enumerate(plan.assign(s.source, s.text_key, s.skip_bad)) if i >= done)
        encoder = ChunkEncoder(tok.to_json(), tok.eot_id, tok.bos_ids)
        t0, text_bytes, tokens = time.perf_counter(), 0, 0
        for chunk in encode_stream(encoder, stream, s.workers):
            wrote = writers["train"].add(chunk.train) | writers["val"].add(chunk.val)
            done += chunk.documents
            text_bytes, tokens = text_bytes + chunk.text_bytes, tokens + len(chunk.train) + len(chunk.val)
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.update(task, advance=chunk.documents, rate=f"{text_bytes / dt / 1e6:.1f} MB/s · {tokens / dt:,.0f} tok/s")
            if wrote:
                generation += 1
                save_progress(out, done, writers, generation)
        seconds = time.perf_counter() - t0
    write_meta(out, tok, writers, s.source, plan.bad.count)
    for leftover in [*out.glob("*.npy"), out / PROGRESS]:
        leftover.unlink(missing_ok=True)
    return {"documents": total, "text_bytes": text_bytes, "tokens": tokens, "seconds": seconds,
            "workers": s.workers, "bad": plan.bad}


def write_meta(out: Path, tok: TextTokenizer, writers: dict[str, ShardWriter], source: str,
               skipped_records: int = 0) -> None:
    """Close the splits' writers and write meta.json: the last file of a prepared directory."""
    for w in writers.values():
        w.close()
    meta = {
        "format": FORMAT, "version": VERSION, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
        "eot_token": tok.id_to_token(tok.eot_id), "bos_ids": list(tok.bos_ids),
        "train_tokens": writers["train"].total, "val_tokens": writers["val"].total,
        "train_shards": writers["train"].names, "val_shards": writers["val"].names,
        "source": source_label(source), "skipped_records": skipped_records,
        "unigram_val_loss": unigram_loss(writers["train"].counts, writers["val"].counts),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
