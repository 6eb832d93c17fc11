"""No import cycle inside kvtier: the modules' imports form a directed acyclic graph.

Every import counts, also those inside functions and under ``TYPE_CHECKING``
(see :mod:`tests.source_imports`): a cycle hidden in a function is still two
modules that cannot be understood one without the other. A submodule's import
of its own parent package is implied by Python and does not count.
"""

from __future__ import annotations

from graphlib import CycleError, TopologicalSorter

from tests.source_imports import imports_of, package_modules


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = imports_of(path, modules) & set(modules)
        graph[name] = {other for other in imported if not name.startswith(other + ".")}
    return graph


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "kvtier.kinds" in graph["kvtier.plugins"]
    assert "kvtier.config" in graph
    # imported only inside a function and under TYPE_CHECKING
    assert "kvtier.plugins" in graph["kvtier.config.load"]


def test_kvtier_has_no_import_cycle() -> None:
    try:
        tuple(TopologicalSorter(import_graph()).static_order())
    except CycleError as exc:
        cycle = " -> ".join(exc.args[1])
        raise AssertionError(f"import cycle: {cycle}") from None
