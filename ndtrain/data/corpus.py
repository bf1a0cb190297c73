"""Where documents come from: the embedded corpus or a user's files.

The embedded corpus is the running interpreter's own standard library. Every Python
install carries it, so the default run needs no download, and about 12 MB of real,
varied code is enough to see a small model learn.

A document has a key that does not depend on where the corpus lives (a path relative to
the corpus root, plus a line number for JSONL), so the train/validation split is the
same on every machine.
"""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from ndtrain.data.shards import DataError

STDLIB = "stdlib"
DOCUMENT_SUFFIXES = (".txt", ".md", ".py")
JSONL_SUFFIX = ".jsonl"
# Test suites are mostly fixtures and repetition; installed third-party packages are not
# the standard library and differ between machines.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def _is_excluded_dir(name: str) -> bool:
    return (
        name in EXCLUDED_DIRS
        or name.startswith("test_")
        or name.endswith(("_test", "_tests"))
    )


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, test suites and site-packages left out."""
    root = stdlib_dir()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _is_excluded_dir(d)]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found)


def _user_files(root: Path) -> list[Path]:
    """The document files under a user's directory, sorted; hidden directories skipped."""
    suffixes = DOCUMENT_SUFFIXES + (JSONL_SUFFIX,)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(suffixes))
    return sorted(found)


def source_files(source: str) -> tuple[Path, list[Path]]:
    """Return ``(root, files)``: the files a source reads and the root their keys are relative to."""
    if source == STDLIB:
        return stdlib_dir(), stdlib_files()
    path = Path(source).expanduser().resolve()
    if path.is_dir():
        return path, _user_files(path)
    if not path.exists():
        raise DataError(f"source {source}: no such file or directory (nor the name 'stdlib')")
    if not path.name.endswith(DOCUMENT_SUFFIXES + (JSONL_SUFFIX,)):
        raise DataError(
            f"source {source}: unsupported file type; expected a directory or a "
            f"{', '.join(DOCUMENT_SUFFIXES + (JSONL_SUFFIX,))} file"
        )
    return path.parent, [path]


def is_validation(key: str, fraction: float) -> bool:
    """Whether the document ``key`` belongs to the held-out split.

    crc32 rather than ``hash()``: Python salts string hashes per process, and the split
    must be the same in every process and every run.
    """
    return zlib.crc32(key.encode("utf-8")) / 2**32 < fraction


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"corpus file {path}: cannot read ({e.strerror})") from None


def _jsonl_documents(path: Path, key: str, jsonl_key: str,
                     bad: Callable[[str], None] | None = None) -> Iterator[tuple[str, str]]:
    # Only "\n" ends a line: a JSON string may hold U+2028 and friends unescaped.
    with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                problem = f"{path}:{lineno}: not valid JSON ({e.msg})"
            else:
                if isinstance(record, dict) and isinstance(record.get(jsonl_key), str):
                    yield f"{key}:{lineno}", record[jsonl_key]
                    continue
                problem = f"{path}:{lineno}: each line must be a JSON object with a string field {jsonl_key!r}"
            if bad is None:
                raise DataError(problem)
            bad(problem)


def iter_documents(source: str, jsonl_key: str = "text",
                   bad: Callable[[str], None] | None = None) -> Iterator[tuple[str, str]]:
    """Yield ``(key, text)`` for every document of ``source``.

    ``source`` is ``"stdlib"``, a ``.txt``/``.md``/``.py`` file (one document), a
    ``.jsonl`` file (one document per line, field ``jsonl_key``) or a directory of such
    files. Text is decoded as UTF-8, undecodable bytes replaced rather than fatal: one
    stray byte should not stop a corpus of thousands of files. A malformed record is a
    DataError naming file:line, or, given `bad`, handed to it and skipped.
    """
    root, files = source_files(source)
    for path in files:
        key = path.relative_to(root).as_posix()
        if path.name.endswith(JSONL_SUFFIX):
            yield from _jsonl_documents(path, key, jsonl_key, bad)
        else:
            yield key, _read_text(path)
