"""No circle of imports inside fsdp2/ and recipes/: every package reads one way.

Unlike tests/unit/test_layers.py's cycle test, every import statement counts here: module level,
under ``if TYPE_CHECKING:`` and inside functions (a circle a reader has to untangle is one,
whenever it runs). Circles that exist today and are being taken apart elsewhere are listed in
``ALLOWED``; a circle found must lie inside one of them, and the list only shrinks.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOPS = ("fsdp2", "recipes")

# The circles of 75ae75d outside the planner, each fixed on its own branch: delete an entry when
# its circle is gone. Packages that are clean already may not appear here.
ALLOWED = [
    {"fsdp2", "fsdp2.patch"},
    {"fsdp2.runtime._extension", "fsdp2.runtime._param"},
    {"fsdp2.comm._collectives", "fsdp2.comm._flat", "fsdp2.comm._transport", "fsdp2.comm.cpu._transport"},
    {"fsdp2.runtime._autograd", "fsdp2.runtime._checks", "fsdp2.runtime._group", "fsdp2.runtime._pipeline",
     "fsdp2.runtime._reduce_queue", "fsdp2.runtime._reduction", "fsdp2.runtime._state", "fsdp2.runtime._state_dict"},
    {"recipes.config", "recipes.llama.moe", "recipes.llama.parallelize", "recipes.pipeline"},
]
CLEAN = ("fsdp2.plan", "fsdp2.memory")  # packages that must stay free of circles (never in ALLOWED)


def modules(root: Path, tops: tuple[str, ...] = TOPS) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root/top`` (a package is its ``__init__``)."""
    found = {}
    for top in tops:
        for path in (root / top).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _targets(mods: dict[str, Path], current: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules of ``mods`` one import statement names (``from pkg import mod`` names ``pkg.mod``)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in mods}
    package = current if mods[current].name == "__init__.py" else current.rpartition(".")[0]
    stem = node.module or ""
    if node.level:
        parts = package.split(".")
        stem = ".".join(parts[: len(parts) - node.level + 1] + ([stem] if stem else []))
    named = {f"{stem}.{a.name}" if f"{stem}.{a.name}" in mods else stem for a in node.names}
    return {m for m in named if m in mods}


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of other modules of ``mods``: every import statement, wherever it is."""
    graph = {}
    for name, path in mods.items():
        nodes = (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom)))
        graph[name] = set().union(*(_targets(mods, name, n) for n in nodes)) - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
                on_stack.discard(w)
            on_stack.discard(v)
            if component:
                found.append(component | {v})

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_new_import_circle() -> None:
    found = circles(import_graph(modules(REPO)))
    new = [c for c in found if not any(c <= allowed for allowed in ALLOWED)]
    assert not new, "import circles (any import statement counts; split what they share into a module below " \
                    "them, or merge them):\n" + "\n".join("  " + " <-> ".join(sorted(c)) for c in new)


def test_the_planner_and_the_tracker_have_no_allowance() -> None:
    assert not [m for c in ALLOWED for m in c if m.startswith(CLEAN)]


def test_the_planner_builds_on_the_tracker_one_way() -> None:
    """fsdp2.plan imports fsdp2.memory (the tracker); no fsdp2.memory module names fsdp2.plan."""
    graph = import_graph(modules(REPO))
    assert any(m.startswith("fsdp2.memory") for v in graph if v.startswith("fsdp2.plan") for m in graph[v])
    back = sorted(f"{v} -> {m}" for v in graph if v.startswith("fsdp2.memory") for m in graph[v]
                  if m.startswith("fsdp2.plan"))
    assert not back, back


def test_every_kind_of_import_closes_a_circle(tmp_path: Path) -> None:
    """The graph sees relative, function-level and TYPE_CHECKING imports (guards the parser)."""
    pkg = tmp_path / "fsdp2" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "fsdp2" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from ._a import A\n")
    (pkg / "_a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import B\nA = 1\n")
    (pkg / "_b.py").write_text("def f():\n    from . import _c\nB = 2\n")
    (pkg / "_c.py").write_text("import fsdp2.sub._a\n")
    (pkg / "_d.py").write_text("from . import _a\n")
    found = circles(import_graph(modules(tmp_path, ("fsdp2",))))
    assert found == [{"fsdp2.sub._a", "fsdp2.sub._b", "fsdp2.sub._c"}]
