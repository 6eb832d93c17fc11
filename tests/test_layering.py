"""Packages import downward only: CUDA under copy and tiers, test doubles outside the product,
and no library module importing the command line, the repository's tools or its tests.

Every import counts, also those inside functions and under ``TYPE_CHECKING``
(see :mod:`tests.source_imports`).
"""

from __future__ import annotations

import pytest

from tests.source_imports import PACKAGE, imports_in_source, imports_of, package_modules


def imported_packages(package: str) -> set[str]:
    """The other ``kvtier`` subpackages and modules that the modules of ``package`` import."""
    modules = sorted((PACKAGE / package).rglob("*.py"))
    assert modules, f"kvtier/{package} has no modules"
    found: set[str] = set()
    for module in modules:
        names = imports_of(module)
        found.update(name.split(".")[1] for name in names if name.startswith("kvtier."))
    return found - {package}


def test_every_import_statement_counts() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import kvtier.keys\n"
        "if TYPE_CHECKING:\n"
        "    from kvtier.cli import main\n"
        "def later():\n"
        "    import tests.conftest\n"
        "    from kvtier import config\n"
    )
    assert imports_in_source(source, {"kvtier.config"}) == {
        "typing",
        "kvtier.keys",
        "kvtier.cli",
        "tests.conftest",
        "kvtier.config",
    }


def test_cuda_imports_neither_copy_nor_tiers() -> None:
    assert imported_packages("cuda").isdisjoint({"copy", "tiers"})


def test_copy_and_tiers_do_not_import_each_other() -> None:
    assert "cuda" in imported_packages("tiers"), "pinning comes from kvtier.cuda"
    assert "copy" not in imported_packages("tiers")
    assert "tiers" not in imported_packages("copy")


PRODUCT_PACKAGES = sorted(
    path.name
    for path in PACKAGE.iterdir()
    if (path / "__init__.py").exists() and path.name != "testing"
)


@pytest.mark.parametrize("package", PRODUCT_PACKAGES)
def test_product_packages_do_not_import_test_helpers(package: str) -> None:
    assert "testing" not in imported_packages(package)


COMMAND_LINE = ("kvtier.cli", "kvtier.__main__")
"""The command line: it may import every layer; no layer imports it."""

OUTSIDE_THE_LIBRARY = (
    "kvtier.cli",
    "tests",
    "benchmarks",
    "examples",
    "dashboards",
    "docs",
    "conftest",
)
"""What no library module may import: the command line, the repository's tools and its tests."""


def _within(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


LIBRARY_MODULES = {
    name: path for name, path in package_modules().items() if not _within(name, COMMAND_LINE)
}


def test_the_library_is_every_module_but_the_command_line() -> None:
    assert {"kvtier.plugins", "kvtier.simulator", "kvtier.copy.base"} <= set(LIBRARY_MODULES)
    assert not {"kvtier.cli", "kvtier.cli.bench", "kvtier.cli.simulate"} & set(LIBRARY_MODULES)


@pytest.mark.parametrize("module", sorted(LIBRARY_MODULES))
def test_library_does_not_import_the_command_line_tools_or_tests(module: str) -> None:
    imported = imports_of(LIBRARY_MODULES[module])
    assert sorted(name for name in imported if _within(name, OUTSIDE_THE_LIBRARY)) == []
