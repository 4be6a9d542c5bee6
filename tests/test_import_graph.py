"""The import graph keeps the layers of docs/architecture.md ("Layers"): no module imports one in
a layer above its own, no two folders import each other, and no modules import each other round
a loop. Every import counts, at module level, inside a function or under TYPE_CHECKING (a lazy
import is still a dependency)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tandem"

# Bottom to top. A unit is a folder under tandem/ or a top-level module ("tandem" is the
# package's own __init__: LLM, SamplingParams). Units of one layer may import each other in one
# direction only.
LAYERS: list[tuple[str, ...]] = [
    ("core", "config", "heap"),
    ("kernels",),
    ("models",),
    ("executor",),
    ("engine", "tandem"),
    ("server",),
    ("cluster",),
    ("workload", "sim"),
    ("bench", "tools"),
    ("cli",),
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tandem"


def _imports(path: Path) -> set[str]:
    """Every tandem module `path` imports (`from a import b` names a.b too, which may be a
    module)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m == "tandem" or m.startswith("tandem.")}


def _edges() -> set[tuple[str, str]]:
    """(importing module, imported module), both tandem modules that exist."""
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {(_module_name(f), m) for f in files for m in _imports(f) if m in modules}


EDGES = _edges()


def _circles(edges: set[tuple[str, str]]) -> list[set[str]]:
    """Each set of two or more modules that import each other round a loop (a strongly
    connected component of the import graph)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
    reach = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        reach[start] = seen
    circles: list[set[str]] = []
    for m in sorted(graph):
        if m in reach[m] and not any(m in c for c in circles):
            circles.append({w for w in reach[m] if m in reach.get(w, ())})
    return circles


def test_every_unit_has_a_layer():
    units = {_unit(m) for edge in EDGES for m in edge} | {
        _unit(_module_name(f)) for f in PACKAGE.rglob("*.py")
    }
    assert units <= set(RANK), (
        f"add {sorted(units - set(RANK))} to LAYERS and to docs/architecture.md"
    )


def test_no_import_points_to_a_layer_above():
    upward = sorted((a, b) for a, b in EDGES if RANK.get(_unit(b), -1) > RANK.get(_unit(a), -1))
    assert not upward, "imports into a layer above:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in upward
    )


def test_no_two_folders_import_each_other():
    between = {(_unit(a), _unit(b)) for a, b in EDGES if _unit(a) != _unit(b)}
    mutual = sorted((a, b) for a, b in between if (b, a) in between and a < b)
    detail = [
        f"  {a} <-> {b}: "
        + ", ".join(sorted(f"{x} -> {y}" for x, y in EDGES if {_unit(x), _unit(y)} == {a, b}))
        for a, b in mutual
    ]
    assert not mutual, "folders that import each other:\n" + "\n".join(detail)


def test_no_modules_import_each_other_round_a_loop():
    circles = _circles(EDGES)
    detail = [
        "  " + ", ".join(f"{a} -> {b}" for a, b in sorted(EDGES) if a in c and b in c)
        for c in circles
    ]
    assert not circles, "modules that import each other round a loop:\n" + "\n".join(detail)


def test_circles_are_found():
    """The finder itself: a loop of three is one circle; a module it reaches, and one that
    imports itself, are not in it."""
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "d"), ("e", "a")}
    assert _circles(edges) == [{"a", "b", "c"}]


@pytest.mark.parametrize(
    "source, expect",
    [
        ("import tandem.models.llama\n", {"tandem.models.llama"}),
        (
            "def f():\n    from tandem.executor import attention\n",
            {"tandem.executor", "tandem.executor.attention"},
        ),
        (
            "from ..core.request import Request\n",
            {"tandem.core.request", "tandem.core.request.Request"},
        ),
        ("from . import cluster\n", {"tandem.sim", "tandem.sim.cluster"}),
    ],
)
def test_imports_are_found(tmp_path, monkeypatch, source, expect):
    """The parser itself: absolute, function-level and relative imports are all seen."""
    folder = tmp_path / "tandem" / "sim"
    folder.mkdir(parents=True)
    (folder / "x.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "tandem")
    assert _imports(folder / "x.py") == expect
