"""Preparing a mixture: every source tokenized by one tokenizer, each into its own cached
prepared directory (prepare.py), so a source shared by two mixtures is prepared once.

The tokenizer is `data.tokenizer` when given; else the tokenizer of a source that is
already a prepared folder; else a byte-level BPE trained once on the training documents of
every source together, cached under ``<cache_dir>/data/`` by a hash of the sources and the
vocabulary size.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ndtrain.data import sources as formats
from ndtrain.data.mixture import PreparedMixture, Source
from ndtrain.data.build import FORMAT, plan_split
from ndtrain.data.prepare import PreparedData, _build_lock, _is_prepared_dir, _lock_path, _source_identity
from ndtrain.data.shards import DataError
from ndtrain.data.token_files import prepare_source
from ndtrain.data.tokenizer import TextTokenizer


@dataclass
class SourceSpec:
    name: str
    path: str
    weight: float
    text_key: str = "text"
    repeat: bool = True


def check_specs(specs: Sequence[SourceSpec]) -> None:
    """Every source exists and its first file has the text field, before anything is
    prepared (a bad fourth source must not leave three prepared ones behind)."""
    for s in specs:
        path = Path(s.path).expanduser().resolve()
        if _is_prepared_dir(path):
            continue
        try:
            formats.check_source(path, s.text_key)
        except DataError as e:
            raise DataError(f"data source {s.name!r}: {e}") from None


def _train_into(final: Path, specs, vocab_size: int, val_fraction: float, progress: bool, skip_bad: bool) -> None:
    if progress:
        print(f"training a BPE tokenizer of {vocab_size} on the training documents of {len(specs)} sources once "
              f"→ {final}", flush=True)
    texts = itertools.chain.from_iterable(
        (text for is_val, text in plan_split(s.path, s.text_key, val_fraction, skip_bad).assign(
            s.path, s.text_key, skip_bad) if not is_val) for s in specs)
    tok = TextTokenizer.train(texts, vocab_size)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    try:
        tok.save(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _train_tokenizer(specs, vocab_size: int, val_fraction: float, cache_dir, progress: bool,
                     skip_bad: bool) -> str:
    inputs = {"format": FORMAT, "vocab_size": vocab_size, "val_fraction": val_fraction,
              "sources": [[_source_identity(s.path), s.text_key] for s in specs]}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    final = Path(cache_dir).expanduser() / "data" / f"tokenizer-mixture-{digest}.json"
    if final.is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final, progress):  # torchrun's ranks ask at once: one trains, the others wait
        if not final.is_file():
            _train_into(final, specs, vocab_size, val_fraction, progress, skip_bad)
            _lock_path(final).unlink(missing_ok=True)  # whoever waits finds `final`; later ones take no lock
    return str(final)


def shared_tokenizer(specs, tokenizer: str, vocab_size: int, val_fraction: float, cache_dir, progress: bool,
                     skip_bad: bool = False) -> str:
    """The tokenizer.json every source of the mixture is tokenized with."""
    if tokenizer:
        return tokenizer
    prepared = [s for s in specs if _is_prepared_dir(Path(s.path).expanduser())]
    if prepared:
        return str(Path(prepared[0].path).expanduser() / "tokenizer.json")
    ids = [s.name for s in specs if formats.is_token_source(s.path)]
    if ids:
        raise DataError(f"data source {ids[0]!r} holds token ids: name the tokenizer that made them (data.tokenizer)")
    return _train_tokenizer(specs, vocab_size, val_fraction, cache_dir, progress, skip_bad)


def prepare_mixture(specs: Sequence[SourceSpec], tokenizer: str = "", vocab_size: int = 4096,
                    val_fraction: float = 0.05, cache_dir: str | Path = "~/.cache/ndtrain",
                    progress: bool = True, workers: int = 0, on_bad_record: str = "error") -> PreparedMixture:
    """Every source prepared (or found in the cache) with one tokenizer, one after another,
    each on `workers` processes (prepare.prepare_data)."""
    check_specs(specs)
    tok = shared_tokenizer(specs, tokenizer, vocab_size, val_fraction, cache_dir, progress, on_bad_record == "skip")
    paths = []
    for s in specs:
        try:
            paths.append(prepare_source(s.path, tokenizer=tok, vocab_size=vocab_size, val_fraction=val_fraction,
                                      cache_dir=cache_dir, text_key=s.text_key, progress=progress,
                                      workers=workers, on_bad_record=on_bad_record))
        except DataError as e:
            raise DataError(f"data source {s.name!r}: {e}") from None
    return open_mixture(specs, paths)


def open_mixture(specs: Sequence[SourceSpec], paths: Sequence[str | Path]) -> PreparedMixture:
    """The mixture of prepared directories `paths`, one per source of `specs`."""
    return PreparedMixture([Source(s.name, s.weight, s.repeat, PreparedData.open(p)) for s, p in zip(specs, paths)])
