"""The rooms of the code keep their shape: dependencies point one way, no module imports one
that imports it back (counting imports inside functions and for type checking), and a
module past 400 lines says in its docstring why it is one piece."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> installed package (setuptools' package-dir mapping).
FOLDERS = {"dasktrain": "dasktrain", "datasets": "dasktrain.datasets",
           "pipeline": "dasktrain.pipeline", "trainer": "dasktrain.trainer",
           "evolve": "dasktrain.evolve"}
GROUND = ("dasktrain._cluster", "dasktrain._deadline", "dasktrain._durable",
          "dasktrain._progress", "dasktrain._malloc", "dasktrain._embedded_worker",
          "dasktrain._hosts", "dasktrain._host_cluster", "dasktrain._remote",
          "dasktrain.errors")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts
                     if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every dasktrain module ``path`` imports, wherever the statement stands: ``from a.b
    import c`` names a.b.c if that is a module, else a.b."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                named.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
    return {n for n in named if n in MODULES}


GRAPH = {module: _imports(path) - {module} for module, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
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

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert _cycles() == []


def test_dependencies_point_one_way():
    def users(prefix: str, of: tuple[str, ...]) -> list[str]:
        return sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if m.startswith(prefix)
                      for d in deps if d.startswith(of))

    assert users("dasktrain.datasets", ("dasktrain.pipeline", "dasktrain.trainer")) == []
    assert users("dasktrain.pipeline", ("dasktrain.trainer",)) == []
    # Gradient-free training builds on the other parts; none of them needs it.
    for part in ("dasktrain.datasets", "dasktrain.pipeline", "dasktrain.trainer"):
        assert users(part, ("dasktrain.evolve",)) == []
    for ground in GROUND:
        parts = [d for d in GRAPH[ground]
                 if d.startswith(("dasktrain.datasets", "dasktrain.pipeline",
                                  "dasktrain.trainer", "dasktrain.evolve",
                                  "dasktrain.cli"))]
        assert parts == [], f"{ground} is ground and imports {parts}"


def test_a_long_module_says_why_it_is_one_piece():
    long = []
    for module, path in MODULES.items():
        if len(path.read_text().splitlines()) > MAX_LINES:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            if "one piece" not in " ".join(doc.split()):
                long.append(f"{module} ({len(path.read_text().splitlines())} lines)")
    assert long == [], f"split these, or say in the docstring why each is one piece: {long}"


def test_the_checks_see_a_cycle_where_there_is_one():
    """The cycle finder is not vacuous: it finds one made on purpose."""
    GRAPH["dasktrain.datasets.format"] = GRAPH["dasktrain.datasets.format"] | {
        "dasktrain.datasets.dataset"}
    try:
        assert any("dasktrain.datasets.format" in c for c in _cycles())
    finally:
        GRAPH["dasktrain.datasets.format"] = _imports(MODULES["dasktrain.datasets.format"])
