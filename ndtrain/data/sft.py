"""A supervised fine-tuning data set: records → conversations → rendered examples, split
into training and validation, fitted to `seq_len` and counted.

`prepare_sft` does everything that can fail on bad input (reading, rendering, the length
checks), so the command runs it once before any process starts and hands the result to
every rank; the ranks then only pack rows (data/packing.py), which cannot fail.

Sources: `stdlib-functions` (the embedded set, data/instructions.py), a `.jsonl` file, or a
folder of them. Conversations are split by `is_validation(key)`: by record (`file:line`) for
JSONL, by source file for the embedded set.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ndtrain.data import instructions
from ndtrain.data.chat import Conversation, read_jsonl
from ndtrain.data.corpus import is_validation
from ndtrain.data.packing import FitCounts, fit_examples
from ndtrain.data.shards import DataError
from ndtrain.data.template import Example, render

EMBEDDED = (instructions.NAME,)


class Described:
    """What SFT and preference data say of themselves: the tokenizer's vocabulary, and one
    line per split (plus the records left out). Needs `template`, `counts`, `skipped`."""

    @property
    def vocab_size(self) -> int:
        return self.template.vocab_size

    def describe(self) -> str:
        lines = [f"train {self.counts['train'].describe()}", f"validation {self.counts['val'].describe()}"]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped):,} bad records (data.on_bad_record=skip; all in the run's "
                         f"skipped_records.txt), first: {self.skipped[0]}")
        return "\n".join(lines)


@dataclass
class SFTData(Described):
    """Both splits, ready to pack, and what was left out on the way."""

    template: object  # data/template.BuiltinTemplate | HFTemplate
    train: list[Example]
    val: list[Example]
    held_out: list[Conversation]  # the validation conversations, for generation
    counts: dict[str, FitCounts] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # "file:line: why" of records left out



def jsonl_files(source: str, what: str = "SFT data", embedded: tuple[str, ...] = EMBEDDED) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if not any(part.startswith(".") for part in p.parts))
        if not files:
            raise DataError(f"{source}: no .jsonl files in this folder")
        return files
    if not path.is_file():
        raise DataError(f"{source}: no such file or folder (nor an embedded set: {', '.join(embedded)})")
    if path.suffix != ".jsonl":
        raise DataError(f"{source}: {what} is JSONL (one record per line, .jsonl)")
    return [path]


def load_records(source: str, on_bad_record: str, read, embedded: dict, what: str) -> tuple[list, list[str]]:
    """Every record of `source`, `read(path, key_prefix, on_bad_record)` file by file (or
    the embedded set `embedded[source]()`), and the records skipped."""
    if source in embedded:
        return embedded[source](), []
    items, skipped = [], []
    files = jsonl_files(source, what, tuple(embedded))
    root = Path(source).expanduser() if Path(source).expanduser().is_dir() else files[0].parent
    for path in files:
        records = read(path, path.relative_to(root).as_posix(), on_bad_record)
        items += records.conversations
        skipped += records.skipped
    if not items:
        raise DataError(f"{source}: no usable records" + (f" ({len(skipped)} skipped, first: {skipped[0]})" if skipped else ""))
    return items, skipped


def load_conversations(source: str, on_bad_record: str, cache_dir: str) -> tuple[list[Conversation], list[str]]:
    """Every conversation of `source`, and the records skipped."""
    embedded = {instructions.NAME: lambda: instructions.stdlib_functions(cache_dir)}
    return load_records(source, on_bad_record, read_jsonl, embedded, "SFT data")


def split(conversations: list, val_fraction: float) -> tuple[list, list]:
    """Conversations (or anything with a `key`) by key; when the hash leaves a split empty,
    the key nearest the threshold moves over (as data/prepare.py does for documents)."""
    keys = sorted({c.key for c in conversations})
    if len(keys) < 2:
        raise DataError(f"{len(conversations)} record(s) under {len(keys)} key(s): need at least two to hold one out")
    val = {k for k in keys if is_validation(k, val_fraction)}
    score = lambda k: zlib.crc32(k.encode("utf-8"))  # noqa: E731
    if not val:
        val = {min(keys, key=score)}
    elif len(val) == len(keys):
        val.discard(max(keys, key=score))
    return [c for c in conversations if c.key not in val], [c for c in conversations if c.key in val]


def prepare_sft(source: str, template, seq_len: int, truncate: str, val_fraction: float,
                on_bad_record: str = "error", cache_dir: str = "~/.cache/ndtrain") -> SFTData:
    """Read, split, render and fit. Raises DataError (or ShortSequence) on bad input."""
    conversations, skipped = load_conversations(source, on_bad_record, cache_dir)
    train_c, val_c = split(conversations, val_fraction)
    splits = {"train": render(template, train_c), "val": render(template, val_c)}
    shortest = min((ex.length, c.key) for name, c_list in (("train", train_c), ("val", val_c))
                   for ex, c in zip(splits[name], c_list))
    if shortest[0] > seq_len:
        raise ShortSequence(seq_len, shortest[0], shortest[1])
    counts, kept = {}, {}
    for name in splits:
        splits[name], counts[name], kept[name] = fit_examples(splits[name], seq_len, truncate)
    if not splits["train"]:
        raise DataError(f"{source}: no training example fits train.seq_len = {seq_len} ({counts['train'].describe()})")
    if not splits["val"]:
        raise DataError(f"{source}: no validation example fits train.seq_len = {seq_len} ({counts['val'].describe()})")
    return SFTData(template, splits["train"], splits["val"], [val_c[i] for i in kept["val"]], counts, skipped)


class ShortSequence(DataError):
    """`seq_len` is shorter than every example: packing would cut or drop them all."""

    def __init__(self, seq_len: int, shortest: int, key: str):
        self.seq_len, self.shortest, self.key = seq_len, shortest, key
        super().__init__(f"seq_len {seq_len} is smaller than the shortest example ({shortest} positions, {key})")
