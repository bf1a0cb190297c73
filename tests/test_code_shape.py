"""Files stay small and functions short (DESIGN.md, Style): no file in ndtrain/ over 600
lines, no function over 80 lines from its `def` to the end of its body."""

import ast
from pathlib import Path

import ndtrain

ROOT = Path(ndtrain.__file__).parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def sources() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def test_no_file_is_over_600_lines():
    long = [f"{path.relative_to(ROOT.parent)}: {n} lines" for path in sources()
            if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines: " + ", ".join(long)


def test_no_function_is_over_80_lines():
    long = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(long)
