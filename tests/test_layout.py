"""The library's import graph: no two modules of ``composer_diloco/`` import each other, directly or around a loop
(imports inside functions and under ``TYPE_CHECKING`` count: a reader follows them all the same), and the library
imports nothing from the apps above it (``nodes``, ``coordinator``, ``bench``, ``tests``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "composer_diloco"
APPS = ("nodes", "coordinator", "bench", "tests")


def modules() -> dict[str, Path]:
    """``composer_diloco.x.y`` -> its file, packages by their ``__init__.py``."""
    found = {}
    for path in LIBRARY.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name ``path`` imports (relative imports resolved; ``from a import b`` gives ``a`` and ``a.b``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the library modules it imports (a name resolves to its longest prefix that is a module)."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {r for n in imported_names(p, m) if (r := resolve(n)) and r != m} for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_loop():
    """The control: a graph with a loop of three and a pair is reported as two components."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]


def test_no_import_circle_in_the_library():
    graph = import_graph()
    assert len(graph) > 60 and graph["composer_diloco.outer.peer"]  # the graph was read
    assert cycles(graph) == []


def test_the_library_imports_no_app():
    offenders = {m: sorted(n for n in imported_names(p, m) if n.split(".")[0] in APPS)
                 for m, p in modules().items()}
    assert {m: names for m, names in offenders.items() if names} == {}


def test_the_coordinator_imports_no_inner_loop():
    """The round object (`composer_diloco.diloco`) is shared by the node and the coordinator, but the coordinator
    never trains: importing it must not pull in TRL, transformers' Trainer or the inner step (+0.7-2.8 s on every
    coordinator start and every `simulate`, measured on this project's 2-core CI box)."""
    import subprocess
    import sys

    code = ("import sys, coordinator.cli, coordinator.coordinator, composer_diloco.diloco\n"
            "print(sorted(m for m in ('trl', 'transformers.trainer', 'transformers.trainer_callback', "
            "'composer_diloco.inner.step', 'composer_diloco.inner.trainer') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout
