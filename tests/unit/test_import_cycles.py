"""One direction inside every package: no circle of imports in ``fsdp2/`` or ``recipes/``.

Every import statement counts here, module level, under ``if TYPE_CHECKING:`` and inside
functions alike (``test_layers.py`` checks the layers' order and the import-time graph): two
files that name each other, even only for annotations, leave a reader unable to tell which
is the base. docs/design.md ("One direction inside each package") names each package's base
file; it imports no other file of its package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOPS = ("fsdp2", "recipes")
BASE_ROW = re.compile(r"^\|\s*`([\w/]+)/`\s*\|\s*`([\w.]+\.py)`\s*\|")

def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every ``.py`` under the two trees (a package by its own name)."""
    found = {}
    for top in TOPS:
        for path in sorted((REPO / top).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The modules of the two trees that one import statement names (``from pkg import mod``: the module)."""
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    else:
        stem = node.module or ""
        if node.level:
            parts = _package(name, path).split(".")
            stem = ".".join(parts[: len(parts) - node.level + 1] + ([stem] if stem else []))
        named = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
    return {m for m in named if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        nodes = ast.walk(ast.parse(path.read_text()))
        graph[name] = {t for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))
                       for t in _targets(name, path, n, modules)}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _bases() -> dict[str, str]:
    """docs/design.md's table: package directory (``fsdp2/runtime``) -> its base file's name."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split("\n### One direction inside each package", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for line in section.splitlines() if (m := BASE_ROW.match(line))}


def test_the_cycle_finder_finds_a_circle() -> None:
    # Guards the finder itself: a circle of three and one of two, beside a one-way chain.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["d", "e"]]


def test_no_circle_of_imports_in_fsdp2_or_recipes() -> None:
    graph = _graph()
    assert len(graph) > 50 and graph["fsdp2.runtime._group"], "the parser found no imports"
    circles = _circles(graph)
    assert circles == [], "import circles (split what the files share into a file below them):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_every_package_names_its_base() -> None:
    bases = _bases()
    packages = {path.parent.relative_to(REPO).as_posix() for top in TOPS for path in (REPO / top).rglob("*.py")}
    missing = sorted(packages - set(bases))
    assert missing == [], "add a row naming the base file of these packages to docs/design.md"


def test_each_base_imports_nothing_of_its_package() -> None:
    bases = _bases()
    assert len(bases) >= 8  # guards the parser: a format slip would check nothing
    graph = _graph()
    for directory, base in bases.items():
        package = directory.replace("/", ".")
        module = f"{package}.{base.removesuffix('.py')}"
        assert module in graph, f"docs/design.md names {directory}/{base}, which does not exist"
        own = sorted(m for m in graph[module] if m.rpartition(".")[0] == package or m == package)
        assert own == [], f"{directory}/{base} is its package's base but imports {own}"


def test_the_planner_builds_on_the_tracker_one_way() -> None:
    """fsdp2.plan imports fsdp2.memory (the tracker); no fsdp2.memory module names fsdp2.plan."""
    graph = _graph()
    assert any(m.startswith("fsdp2.memory") for v in graph if v.startswith("fsdp2.plan") for m in graph[v])
    back = sorted(f"{v} -> {m}" for v in graph if v.startswith("fsdp2.memory") for m in graph[v]
                  if m.startswith("fsdp2.plan"))
    assert not back, back
