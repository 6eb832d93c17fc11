"""No import cycle inside kvtier: the modules' top-level imports form a directed acyclic graph.

Imports inside functions and under ``TYPE_CHECKING`` run later or never, so they
do not count; a submodule's import of its own parent package is implied by
Python and does not count either.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "kvtier"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(body: list[ast.stmt], modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``body`` imports when it runs.

    ``from X import Y`` imports the module ``X.Y`` where that is one, else ``X``.
    """
    found: set[str] = set()
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= top_level_imports(node.orelse, modules)
        elif isinstance(node, ast.If):
            found |= top_level_imports(node.body + node.orelse, modules)
        elif isinstance(node, ast.Try):
            handlers = [statement for handler in node.handlers for statement in handler.body]
            blocks = node.body + node.orelse + node.finalbody + handlers
            found |= top_level_imports(blocks, modules)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        body = ast.parse(path.read_text(), str(path)).body
        imported = top_level_imports(body, set(modules))
        graph[name] = {other for other in imported if not name.startswith(other + ".")}
    return graph


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "kvtier.kinds" in graph["kvtier.plugins"]
    assert "kvtier.config" in graph


def test_kvtier_has_no_import_cycle() -> None:
    try:
        tuple(TopologicalSorter(import_graph()).static_order())
    except CycleError as exc:
        cycle = " -> ".join(exc.args[1])
        raise AssertionError(f"import cycle: {cycle}") from None
