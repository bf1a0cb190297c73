"""Reading a user's documents: every file format a source may be, and the folders of them.

A source is a file or a folder. The formats (docs/data.md):

- ``.txt``, ``.md``, ``.py``: one document per file;
- ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``: one JSON object per line, the document in the
  field ``text_key``; compressed files are decompressed as a stream by pyarrow's codecs
  (``pyarrow.CompressedInputStream``), so zstd needs no package of its own;
- ``.parquet``: one document per row, column ``text_key``, streamed a record batch at a
  time (``ParquetFile.iter_batches``) so a shard never sits in memory whole;
- ``.arrow``: the Arrow IPC files a Hugging Face ``save_to_disk`` writes, read the same way;
- ``.bin``: token ids already, in the shard format of data/shards.py (token_files.py
  prepares them: no text, no tokenizer training).

A folder is read as a Hugging Face dataset when it looks like one, else as a folder of
documents:

- ``dataset_dict.json`` (``DatasetDict.save_to_disk``): its ``train`` split's folder;
- ``state.json`` listing ``_data_files`` (``Dataset.save_to_disk``): those Arrow files, in
  that order;
- any ``.parquet`` or ``.arrow`` file below it (a hub snapshot of parquet shards): those files
  only, sorted; its README.md and JSON metadata are not documents;
- else any ``.bin`` token file below it: those files, sorted;
- otherwise every ``.txt``/``.md``/``.py``/JSONL file below it, hidden folders skipped.

A document's key is its file's path relative to the source's root, plus ``:N`` (the line of
a JSONL file, the row of a columnar file), so the train/validation split does not depend on
where the source lives.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from ndtrain.data.shards import DataError, read_shard

DOCUMENT_SUFFIXES = (".txt", ".md", ".py")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
TOKEN_SUFFIX = ".bin"  # token ids already, in the shard format of data/shards.py
ALL_SUFFIXES = DOCUMENT_SUFFIXES + JSONL_SUFFIXES + COLUMNAR_SUFFIXES + (TOKEN_SUFFIX,)
CODECS = {".gz": "gzip", ".zst": "zstd"}
BATCH_ROWS = 1024  # rows per record batch read from a columnar file


def _walk(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(suffixes) and not f.startswith("."))
    return sorted(found)


def _saved_dataset_files(root: Path) -> list[Path] | None:
    """The Arrow files of a `save_to_disk` folder, in its order; None if it is not one."""
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"source {root}: a saved DatasetDict without a 'train' split (it has "
                            f"{', '.join(map(str, splits)) or 'none'}); point data.path at the split's folder")
        return _saved_dataset_files(root / "train") or []
    state = root / "state.json"
    if not state.is_file():
        return None
    try:
        names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError):
        raise DataError(f"source {state}: not a Hugging Face save_to_disk state.json (no _data_files list)") from None
    return [root / n for n in names]


def source_files(path: Path) -> list[Path]:
    """The files a user's source (a file or a folder) reads, in reading order."""
    if not path.exists():
        raise DataError(f"source {path}: no such file or directory (nor the name 'stdlib')")
    if path.is_file():
        if not path.name.endswith(ALL_SUFFIXES):
            raise DataError(f"source {path}: unsupported file type; expected a folder or a "
                            f"{', '.join(ALL_SUFFIXES)} file")
        return [path]
    saved = _saved_dataset_files(path)
    if saved is not None:
        return saved
    return (_walk(path, COLUMNAR_SUFFIXES) or _walk(path, (TOKEN_SUFFIX,))
            or _walk(path, DOCUMENT_SUFFIXES + JSONL_SUFFIXES))


def is_token_source(source: str) -> bool:
    """Whether a source is token files (``.bin`` shards of token ids) rather than text."""
    path = Path(source).expanduser()
    if not path.exists() or (path.is_dir() and (path / "meta.json").is_file()):
        return False
    files = source_files(path)
    return bool(files) and all(f.name.endswith(TOKEN_SUFFIX) for f in files)


# ---------------------------------------------------------------------------------------
# One file's documents


def _text_stream(path: Path):
    """A text reader of a possibly compressed file; only "\\n" ends a line (a JSON string may
    hold U+2028 and friends unescaped)."""
    codec = CODECS.get(path.suffix)
    if codec is None:  # no pyarrow import for a plain file: it maps ~100 MB of libraries
        return open(path, encoding="utf-8", errors="replace", newline="\n")
    import pyarrow as pa
    return io.TextIOWrapper(pa.CompressedInputStream(pa.OSFile(str(path)), codec), encoding="utf-8",
                            errors="replace", newline="\n")


def _jsonl_documents(path: Path, key: str, text_key: str,
                     bad: Callable[[str], None] | None = None) -> Iterator[tuple[str, str]]:
    """A malformed line is a DataError naming file:line, or, given `bad`, handed to it and
    skipped (data.on_bad_record = skip); an unreadable file is always an error."""
    try:
        with _text_stream(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                text, problem = _parse_record(line, text_key)
                if problem is None:
                    yield f"{key}:{lineno}", _without_lone_surrogates(text)
                    continue
                if bad is None:
                    raise DataError(f"{path}:{lineno}: {problem}")
                bad(f"{path}:{lineno}: {problem}")
    except OSError as e:  # pyarrow raises OSError for a corrupt compressed stream
        raise DataError(f"{path}: cannot read ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _parse_record(line: str, text_key: str) -> tuple[str, str | None]:
    """One JSONL line's text and None, or "" and what is wrong with the line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return "", f"not valid JSON ({e.msg})"
    except RecursionError:
        return "", "JSON nested too deeply to read"
    if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
        return "", f"each line must be a JSON object with a string field {text_key!r} (the source's text_key)"
    return record[text_key], None


def _without_lone_surrogates(text: str) -> str:
    """A lone surrogate escape ("\\ud800") is half a character: replaced, like an undecodable byte."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _record_batches(path: Path, text_key: str):
    """The record batches of column `text_key` of a parquet or Arrow IPC file, streamed."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        if path.suffix == ".parquet":
            f = pq.ParquetFile(str(path))
            _check_column(path, f.schema_arrow, text_key)
            yield from f.iter_batches(batch_size=BATCH_ROWS, columns=[text_key])
            return
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:  # the random-access file format rather than the stream
            reader = pa.ipc.open_file(source)
        _check_column(path, reader.schema, text_key)
        batches = reader if isinstance(reader, pa.ipc.RecordBatchStreamReader) else (
            reader.get_batch(i) for i in range(reader.num_record_batches))
        for batch in batches:
            yield batch.select([text_key])
    except (pa.ArrowException, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{path}: cannot read as {path.suffix[1:]} ({first})") from None


def _check_column(path: Path, schema, text_key: str) -> None:
    import pyarrow as pa
    if text_key not in schema.names:
        raise DataError(f"{path}: no column {text_key!r} (the source's text_key); its columns are "
                        f"{', '.join(schema.names)}")
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {text_key!r} holds {kind}, not text (the source's text_key)")


def _columnar_documents(path: Path, key: str, text_key: str) -> Iterator[tuple[str, str]]:
    row = 0
    for batch in _record_batches(path, text_key):
        for text in batch.column(0).to_pylist():
            row += 1
            if text:  # a null or empty row is no document
                yield f"{key}:{row}", text


def file_documents(path: Path, key: str, text_key: str,
                   bad: Callable[[str], None] | None = None) -> Iterator[tuple[str, str]]:
    """``(key, text)`` for every document of one file of a source; `bad`: see `_jsonl_documents`."""
    name = path.name
    if name.endswith(TOKEN_SUFFIX):
        raise DataError(f"{path}: holds token ids, not text")
    if name.endswith(JSONL_SUFFIXES):
        yield from _jsonl_documents(path, key, text_key, bad)
    elif name.endswith(COLUMNAR_SUFFIXES):
        yield from _columnar_documents(path, key, text_key)
    else:
        try:
            yield key, path.read_bytes().decode("utf-8", errors="replace")
        except OSError as e:
            raise DataError(f"corpus file {path}: cannot read ({e.strerror})") from None


def file_document_sizes(path: Path, key: str, text_key: str,
                        bad: Callable[[str], None] | None = None) -> Iterator[tuple[str, int]]:
    """``(key, size)`` for every document of one file, size > 0 exactly when its text is not
    empty: a whole-file document's bytes from the file system (nothing read: a file of n > 0
    bytes decodes to at least one character), a record's characters."""
    if path.name.endswith(DOCUMENT_SUFFIXES):
        try:
            yield key, path.stat().st_size
        except OSError as e:
            raise DataError(f"corpus file {path}: cannot read ({e.strerror})") from None
        return
    for k, text in file_documents(path, key, text_key, bad):
        yield k, len(text)


def check_source(path: Path, text_key: str) -> None:
    """Cheap checks before anything is prepared: the source exists and holds readable files,
    and each file has the text field (a columnar file's schema, a JSONL file's first
    record) or, a token file, a sound header. Raises DataError naming the file."""
    files = source_files(path)
    if not files:
        raise DataError(f"source {path}: holds no {', '.join(ALL_SUFFIXES)} file")
    for f in files:
        if not f.is_file():
            raise DataError(f"source {path}: {f} is listed but missing")
        if f.name.endswith(TOKEN_SUFFIX):
            read_shard(f)
        elif f.name.endswith(JSONL_SUFFIXES + COLUMNAR_SUFFIXES):
            next(file_documents(f, f.name, text_key), None)
