"""Packages import one way (DESIGN.md). At the bottom `comm` under `mesh` and `data` under
`model` (with the process helpers, and `kernels`, which imports only torch); `config` on them; `parallel` on `config`; `checkpoint`,
`observe`, `generate` and `replicas` on `parallel`; `train` on those; `bench`, `plan` and `cli` on top.
Every import counts, also one inside a function, and no module may reach itself through its
imports."""

import ast
from pathlib import Path

import ndtrain

ROOT = Path(ndtrain.__file__).parent
LEVELS = {
    0: ("comm", "data", "deferred", "forkserver", "kernels", "supervisor", "testing", "__init__"),
    1: ("mesh", "model", "launch"),
    2: ("config", "idle_keys"),
    3: ("parallel",),
    4: ("checkpoint", "observe", "generate", "replicas"),
    5: ("train",),
    6: ("bench", "plan", "cli"),
}
LEVEL_OF = {top: level for level, tops in LEVELS.items() for top in tops}


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(("ndtrain",) + parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The ndtrain modules `name` imports (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t.startswith("ndtrain")}
    return {t for t in found if t in known and t != name}


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_level():
    assert {top(m) for m in modules()} <= set(LEVEL_OF), "a new package needs a place in LEVELS"


def test_nothing_imports_upward():
    mods = modules()
    bad = []
    for name, path in mods.items():
        for target in imports_of(name, path, set(mods)):
            if LEVEL_OF[top(target)] > LEVEL_OF[top(name)]:
                bad.append(f"{name} -> {target}")
    assert not bad, "upward imports: " + ", ".join(sorted(bad))


def test_no_import_cycles():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):
                continue  # a package's __init__ importing its own modules is not a cycle
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
