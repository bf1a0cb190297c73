"""Turn a corpus into a prepared directory of token shards, once, and reuse it.

A prepared directory holds ``tokenizer.json``, ``train-NNNNN.bin``, ``val-NNNNN.bin``
and ``meta.json``. It lives under ``<cache_dir>/data/`` with a name derived from a hash
of every input that determines its content, so a second run with the same inputs costs
a directory lookup, and a changed input (another Python, an edited file, another
vocabulary size) gets a directory of its own.

A prepared directory appears whole or not at all: it is built in ``.<name>.partial``
beside its final place and renamed into it. One process builds it at a time (a lock file
beside it); another that asks for the same data meanwhile waits and then reads the result.
A build that was interrupted (a crash, ^C, a killed job) continues where it stopped the next
time the same data is asked for (data/build.py records its progress after every shard).

The corpus is read in streaming passes (split plan, tokenizer training, tokenization) and
tokenized on worker processes (data/encode.py), so a corpus larger than memory can be
prepared, in memory bounded by the chunk and shard sizes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from ndtrain.data.build import FORMAT, SPLITS, VERSION, BuildSettings, source_label
from ndtrain.data.build import build as _build
from ndtrain.data.corpus import STDLIB, source_files
from ndtrain.data.encode import worker_count
from ndtrain.data.loader import TokenStream
from ndtrain.data.shards import DataError, read_shard
from ndtrain.data.tokenizer import HF_PREFIX, TextTokenizer, hf_tokenizer_config


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
        # meta.json names the end of text of a Hugging Face tokenizer (hf:DIR), whose name
        # need not be one TextTokenizer.from_file recognises; older directories do not.
        tok = TextTokenizer.from_file(self.path / "tokenizer.json", eot_token=self.meta.get("eot_token"))
        tok.bos_ids = tuple(self.meta.get("bos_ids", ()))
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


def _tokenizer_identity(tokenizer: str, vocab_size: int) -> str:
    """A hash of the files that decide the tokens: tokenizer.json, and for hf:DIR its config
    (the BOS/EOS rules)."""
    if not tokenizer:
        return f"bpe-{vocab_size}"
    if tokenizer.startswith(HF_PREFIX):
        folder = Path(tokenizer[len(HF_PREFIX):]).expanduser()
        hf_tokenizer_config(folder)  # a folder without tokenizer.json is refused by name
        paths = [folder / "tokenizer.json", folder / "tokenizer_config.json"]
    else:
        paths = [Path(tokenizer).expanduser()]
    digest = hashlib.sha256()
    for i, path in enumerate(paths):
        if i and not path.exists():  # an HF folder need not have a tokenizer_config.json
            continue
        try:
            digest.update(path.read_bytes())
        except OSError as e:
            raise DataError(f"tokenizer {path}: cannot read ({e.strerror})") from None
    return ("hf-" if tokenizer.startswith(HF_PREFIX) else "") + digest.hexdigest()


def _cache_name(source: str, tokenizer: str, vocab_size: int, val_fraction: float,
                text_key: str, shard_tokens: int, on_bad_record: str = "error") -> str:
    inputs = {
        "format": [FORMAT, VERSION], "source": _source_identity(source),
        "tokenizer": _tokenizer_identity(tokenizer, vocab_size),
        "val_fraction": val_fraction, "jsonl_key": text_key,  # the old name: caches keep their names
        "shard_tokens": shard_tokens,
    }
    if on_bad_record != "error":  # skipping changes the content; erroring leaves nothing to name
        inputs["on_bad_record"] = on_bad_record
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    # A readable prefix helps a user find their data in the cache; the hash decides.
    label = STDLIB if source == STDLIB else Path(source).expanduser().resolve().name
    label = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:40] or "data"
    return f"{label}-{digest}"


# ---------------------------------------------------------------------------------------
# Entry point


def prepare_data(
    source: str = STDLIB,
    tokenizer: str = "",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    cache_dir: str | Path = "~/.cache/ndtrain",
    text_key: str = "text",
    progress: bool = True,
    shard_tokens: int = 1 << 24,
    workers: int = 0,
    on_bad_record: str = "error",
    build_tokens=None,
) -> Path:
    """Return a prepared directory for ``source``, building it only if the cache lacks it.

    ``source`` is ``"stdlib"``, a corpus file or directory, or an already prepared
    directory (returned as is). ``tokenizer`` is a ``tokenizer.json`` to use, ``hf:DIR`` (a
    Hugging Face model folder's, with its family's BOS/EOS), or ``""`` to train a byte-level
    BPE of ``vocab_size`` on the training documents. ``workers`` processes tokenize (0: one
    per core, fewer for a small corpus); the result does not depend on how many.
    ``on_bad_record``: a malformed record stops the build naming file:line (``error``) or is
    counted and skipped (``skip``). ``build_tokens``: a source of token files is prepared by
    it (token_files.prepare_source), which splits and copies them.

    The build writes into ``.<name>.partial`` beside its final place, under a lock, and
    records its progress there: a build that was interrupted continues where it stopped.
    """
    source = str(source)
    if source != STDLIB and _is_prepared_dir(Path(source).expanduser()):
        return PreparedData.open(source).path
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction}: must lie strictly between 0 and 1")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens {shard_tokens}: must be at least 1")
    if on_bad_record not in ("error", "skip"):
        raise DataError(f"on_bad_record {on_bad_record!r}: must be error or skip")

    if build_tokens is not None and not tokenizer:
        raise DataError(f"source {source}: holds token ids; name the tokenizer that made them (data.tokenizer)")
    name = _cache_name(source, tokenizer, vocab_size, val_fraction, text_key, shard_tokens, on_bad_record)
    final = Path(cache_dir).expanduser() / "data" / name
    if final.exists():
        return PreparedData.open(final).path
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final, progress):
        if final.exists():  # another process built it while this one waited
            return PreparedData.open(final).path
        partial = final.parent / f".{name}.partial"
        partial.mkdir(exist_ok=True)
        n = 1 if build_tokens else worker_count(workers, sum(p.stat().st_size for p in source_files(source)[1]))
        if progress:  # a log (no terminal, no bar) should still say what these seconds are
            what = "the standard library" if source == STDLIB else source
            how = "token files split and copied" if build_tokens else (
                f"{'BPE tokenizer, ' if not tokenizer else ''}token shards on {n} process{'es' if n > 1 else ''}")
            print(f"preparing {what} once: {how} → {final}", flush=True)
        settings = BuildSettings(source, tokenizer, vocab_size, val_fraction, text_key, shard_tokens, n,
                                 on_bad_record == "skip", progress)
        try:
            if build_tokens is not None:  # token ids already: split and copied (data/token_files.py)
                done = build_tokens(partial, source, tokenizer, val_fraction, shard_tokens)
            else:
                done = _build(partial, settings)
        except DataError:  # bad input: nothing is left behind (an interruption keeps its progress)
            shutil.rmtree(partial, ignore_errors=True)
            _lock_path(final).unlink(missing_ok=True)
            raise
        os.chmod(partial, 0o755)
        os.rename(partial, final)
        # Whoever waits on this lock finds `final` when it gets it; whoever comes later, before
        # taking a lock.
        _lock_path(final).unlink(missing_ok=True)
    if progress and done is not None:
        _report(done)
    return PreparedData.open(final).path


def _lock_path(final: Path) -> Path:
    return final.parent / f".{final.name}.lock"


@contextmanager
def _build_lock(final: Path, progress: bool):
    """One build of a directory at a time: a second process waits, then finds it built."""
    with open(_lock_path(final), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another process preparing {final.name}", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _report(done: dict) -> None:
    rate = done["text_bytes"] / max(done["seconds"], 1e-9)
    print(f"tokenized {done['text_bytes'] / 1e6:,.1f} MB ({done['tokens']:,} tokens) in {done['seconds']:.1f} s: "
          f"{rate / 1e6:.1f} MB/s, {done['tokens'] / max(done['seconds'], 1e-9):,.0f} tokens/s on "
          f"{done['workers']} process{'es' if done['workers'] > 1 else ''}", flush=True)
    bad = done["bad"]
    if bad.count:
        print(f"skipped {bad.count:,} malformed record{'s' if bad.count > 1 else ''} (data.on_bad_record = skip); "
              f"first: {bad.first[0]}", flush=True)
