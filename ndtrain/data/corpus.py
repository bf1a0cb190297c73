"""Where documents come from: the embedded corpus or a user's files.

The embedded corpus is the running interpreter's own standard library. Every Python
install carries it, so the default run needs no download, and about 12 MB of real,
varied code is enough to see a small model learn.

A document has a key that does not depend on where the corpus lives (a path relative to
the corpus root, plus a line number for JSONL), so the train/validation split is the
same on every machine.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from ndtrain.data import sources

STDLIB = "stdlib"
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


def source_files(source: str) -> tuple[Path, list[Path]]:
    """Return ``(root, files)``: the files a source reads and the root their keys are relative to."""
    if source == STDLIB:
        return stdlib_dir(), stdlib_files()
    path = Path(source).expanduser().resolve()
    return (path if path.is_dir() else path.parent), sources.source_files(path)


def is_validation(key: str, fraction: float) -> bool:
    """Whether the document ``key`` belongs to the held-out split.

    crc32 rather than ``hash()``: Python salts string hashes per process, and the split
    must be the same in every process and every run.
    """
    return zlib.crc32(key.encode("utf-8")) / 2**32 < fraction


def iter_documents(source: str, text_key: str = "text",
                   bad: Callable[[str], None] | None = None) -> Iterator[tuple[str, str]]:
    """Yield ``(key, text)`` for every document of ``source``: ``"stdlib"``, or a file or
    folder of any format data/sources.py reads (the text in field or column ``text_key``,
    a source's ``text_key``). Text is decoded as UTF-8, undecodable bytes replaced rather
    than fatal: one stray byte should not stop a corpus of thousands of files. A malformed
    record is a DataError naming file:line, or, given `bad`, handed to it and skipped."""
    root, files = source_files(source)
    for path in files:
        yield from sources.file_documents(path, path.relative_to(root).as_posix(), text_key, bad)


def iter_document_sizes(source: str, text_key: str = "text",
                        bad: Callable[[str], None] | None = None) -> Iterator[tuple[str, int]]:
    """``(key, size)`` for every document of ``source``, as `iter_documents` yields them; size
    is 0 exactly for an empty document. Whole-file documents are not read (their size is
    the file's), so a split plan over a folder of files costs a directory walk."""
    root, files = source_files(source)
    for path in files:
        yield from sources.file_document_sizes(path, path.relative_to(root).as_posix(), text_key, bad)
