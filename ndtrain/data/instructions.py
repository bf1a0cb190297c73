"""The embedded instruction set: functions of the Python standard library, asked for by
their signature and docstring and answered with their body.

Every function (or method) with a docstring and at least one statement after it is one
conversation: the user gives the `def` line(s) and the docstring, dedented, and asks for
the body; the assistant answers with the lines after the docstring (comments included),
dedented alike. Each conversation's key is its file's path relative to the standard
library, the key pretraining splits that file by (data/corpus.is_validation), so with the
same `val_fraction` the held-out functions come from files the pretrained model never saw.

Parsing the ~1,000 files takes seconds, so the set is cached as JSONL under
`<cache_dir>/sft/`, named by the interpreter's version and the files' sizes.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import tempfile
import textwrap
from pathlib import Path

from ndtrain.data.chat import Conversation, Turn
from ndtrain.data.corpus import stdlib_dir, stdlib_files

NAME = "stdlib-functions"
INSTRUCTION = "Write the body of this Python function.\n\n"
FORMAT_VERSION = 1


def _functions(path: Path, key: str) -> list[Conversation]:
    source = path.read_bytes().decode("utf-8", errors="replace")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        doc = node.body[0]
        if len(node.body) < 2 or node.body[1].lineno <= doc.end_lineno:
            continue
        head = "".join(lines[node.lineno - 1:doc.end_lineno])
        body = "".join(lines[doc.end_lineno:node.end_lineno])
        text = textwrap.dedent(head + body)
        n_head = head.count("\n")
        cut = sum(len(line) for line in text.splitlines(keepends=True)[:n_head])
        head, body = text[:cut], text[cut:]
        if body.strip():
            out.append(Conversation(key, [Turn("user", INSTRUCTION + head), Turn("assistant", body, True)]))
    return out


def build() -> list[Conversation]:
    root = stdlib_dir()
    return [c for path in stdlib_files() for c in _functions(path, path.relative_to(root).as_posix())]


def _cache_path(cache_dir: str | Path) -> Path:
    import sys
    root = stdlib_dir()
    identity = [sys.version.split()[0], FORMAT_VERSION,
                [[p.relative_to(root).as_posix(), p.stat().st_size] for p in stdlib_files()]]
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "sft" / f"{NAME}-{digest}.jsonl"


def stdlib_functions(cache_dir: str | Path) -> list[Conversation]:
    """The embedded instruction set, from the cache or built (then cached, atomically)."""
    path = _cache_path(cache_dir)
    if path.is_file():
        records = [json.loads(line) for line in path.read_text().splitlines()]
        return [Conversation(r["key"], [Turn("user", r["prompt"]), Turn("assistant", r["answer"], True)])
                for r in records]
    conversations = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        for c in conversations:
            f.write(json.dumps({"key": c.key, "prompt": c.turns[0].content, "answer": c.answer}) + "\n")
    os.replace(tmp, path)
    return conversations
