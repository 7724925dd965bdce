"""The package's layers, as docs/design.md draws them: imports only point down, and there is no cycle.

For the order and the cycles, only imports that run when a module is imported count: those
under ``if TYPE_CHECKING:`` are annotations, and those inside functions are deferred on
purpose (the transport interface imports its CPU implementation only when a CPU group picks
it; tests/unit/test_import_cycles.py counts every import statement for circles). The one-way
rule counts annotations too: a lower layer names no upper layer's type, not even for
annotations (the transport is handed layouts and sources, not the runtime's objects).
"""

from __future__ import annotations

import ast
import pathlib

import fsdp2

PACKAGE = pathlib.Path(fsdp2.__file__).parent

# Bottom to top. A module may import modules of its own layer or of layers below it.
LAYERS = [
    ("leaf", ["fsdp2._common", "fsdp2._compat", "fsdp2._errors", "fsdp2._format", "fsdp2._wire", "fsdp2._api"]),
    ("diagnostics", ["fsdp2.diagnostics"]),
    ("transport", ["fsdp2.comm"]),
    ("runtime", ["fsdp2.runtime"]),
    ("api and tools", ["fsdp2", "fsdp2._wrap", "fsdp2._clip", "fsdp2.patch", "fsdp2.memory", "fsdp2.checkpoint"]),
    ("planner", ["fsdp2.plan"]),  # builds on the tracker (fsdp2.memory), which never names it
]


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    best, where = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), index
    assert where is not None, f"{module} is in no layer of LAYERS: add it"
    return where


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _import_time_imports(path: pathlib.Path) -> set[str]:
    """fsdp2 modules ``path`` imports at module level (not under TYPE_CHECKING, not in functions)."""
    module = _name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, block, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                if not base.startswith("fsdp2"):
                    continue
                for alias in node.names:  # ``from pkg import module`` names a module
                    candidate = f"{base}.{alias.name}"
                    as_module = PACKAGE.parent / (candidate.replace(".", "/") + ".py")
                    found.add(candidate if as_module.exists() or (as_module.with_suffix("")).is_dir() else base)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("fsdp2"))

    visit(ast.parse(path.read_text()).body)
    found.discard(module)
    return found


def _graph() -> dict[str, set[str]]:
    return {_name(p): _import_time_imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _every_import(path: pathlib.Path) -> set[str]:
    """fsdp2 modules (or packages) ``path`` names anywhere: module level, under TYPE_CHECKING,
    inside functions."""
    module = _name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("fsdp2"):
                found.update(f"{base}.{a.name}" if (PACKAGE.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(
                    ".py").exists() else base for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fsdp2"))
    found.discard(module)
    return found




def test_no_lower_layer_names_an_upper_layer_type():
    """The transport hands back what arrived and never names the runtime's types, even in
    annotations; deferred imports (inside functions) count too, except the transport's
    choice of its CPU implementation, which is the same layer."""
    upward = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _name(path)
        for imported in _every_import(path):
            if imported != "fsdp2" and _layer(imported) > _layer(module):
                upward.add((module, imported))
    found = "\n".join(f"{a} -> {b}" for a, b in sorted(upward))
    assert not upward, f"lower layers naming upper layers' modules:\n{found}"


def test_imports_only_point_down():
    upward = []
    for module, imports in _graph().items():
        for imported in imports:
            if imported != "fsdp2" and _layer(imported) > _layer(module):
                upward.append(f"{module} ({LAYERS[_layer(module)][0]}) imports {imported} "
                              f"({LAYERS[_layer(imported)][0]})")
    assert not upward, "\n".join(upward)


def test_the_flat_transport_does_not_import_the_cpu_one():
    """GPU users read the interface and the flat transport and never meet the CPU one."""
    graph = _graph()
    for module in ("fsdp2.comm._interface", "fsdp2.comm._transport", "fsdp2.comm._flat", "fsdp2.comm._collectives",
                   "fsdp2.runtime._group"):
        assert not {m for m in graph[module] if m.startswith("fsdp2.comm.cpu")}, module


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in graph:
                continue
            if state.get(imported) == 1:
                cycle = path[path.index(imported):] + [imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported)
        path.pop()
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module)
