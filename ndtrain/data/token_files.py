"""Sources that are token ids already: ``.bin`` files in the shard format of data/shards.py
(a 32-byte header, then little-endian uint16 or uint32 ids; `write_shard` writes one), a
file or a folder of them, tokenized elsewhere by the tokenizer that `data.tokenizer` names.

Preparing one splits and copies, in chunks (memory bounded by the shard size, never the
file's): the tail of each file, about `val_fraction` of its tokens, cut just after an
end-of-text id where the file has one there, is the validation split; the rest is the
training split. Every id must lie below the tokenizer's vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ndtrain.data.build import SPLITS, ShardWriter, write_meta
from ndtrain.data.prepare import STDLIB, prepare_data
from ndtrain.data.shards import DataError, read_shard
from ndtrain.data.sources import is_token_source, source_files
from ndtrain.data.tokenizer import TextTokenizer

SCAN = 1 << 20  # tokens looked at a time, backwards, for the cut's end-of-text id


def cut_point(tokens: np.ndarray, val_fraction: float, eot_id: int) -> int:
    """Where a file's validation tail starts: just after the last end-of-text id at or before
    (1 − val_fraction) of it (that document stays whole in training), else at that point."""
    target = min(max(int(len(tokens) * (1 - val_fraction)), 1), len(tokens) - 1)
    stop = target
    while stop > 0:
        start = max(0, stop - SCAN)
        hits = np.flatnonzero(np.asarray(tokens[start:stop]) == eot_id)
        if len(hits):
            return start + int(hits[-1]) + 1
        stop = start
    return target


def build_from_tokens(out: Path, source: str, tokenizer: str, val_fraction: float, shard_tokens: int) -> None:
    """Write a prepared directory into `out` from the token files of `source`."""
    tok = TextTokenizer.load(tokenizer)
    tok.save(out / "tokenizer.json")
    writers = {s: ShardWriter(out, s, shard_tokens, tok.vocab_size) for s in SPLITS}
    for path in source_files(Path(source).expanduser().resolve()):
        tokens = read_shard(path, verify=True)
        if len(tokens) < 2:
            raise DataError(f"{path}: {len(tokens)} token ids; a token file needs at least 2 (train and validation)")
        cut = cut_point(tokens, val_fraction, tok.eot_id)
        for split, lo, hi in (("train", 0, cut), ("val", cut, len(tokens))):
            for start in range(lo, hi, shard_tokens):
                chunk = np.asarray(tokens[start:min(hi, start + shard_tokens)], dtype=np.uint32)
                top = int(chunk.max())
                if top >= tok.vocab_size:
                    raise DataError(f"{path}: holds token id {top}, outside the {tok.vocab_size} ids of "
                                    f"tokenizer {tokenizer}")
                writers[split].add(chunk)
    write_meta(out, tok, writers, source)


def prepare_source(source: str, **kwargs) -> Path:
    """`prepare.prepare_data` for any source: token files are split and copied
    (`build_from_tokens`), text is tokenized."""
    tokens = str(source) != STDLIB and is_token_source(str(source))
    return prepare_data(source, **kwargs, build_tokens=build_from_tokens if tokens else None)
