"""Packages import downward only: CUDA under copy and tiers, test doubles outside the product."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "kvtier"


def imported_packages(package: str) -> set[str]:
    """The other ``kvtier`` subpackages and modules that the modules of ``package`` import.

    Every import statement counts, also those inside functions.
    """
    modules = sorted((PACKAGE / package).rglob("*.py"))
    assert modules, f"kvtier/{package} has no modules"
    found: set[str] = set()
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text(), str(module))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found.update(name.split(".")[1] for name in names if name.startswith("kvtier."))
    return found - {package}


def test_cuda_imports_neither_copy_nor_tiers() -> None:
    assert imported_packages("cuda").isdisjoint({"copy", "tiers"})


def test_copy_and_tiers_do_not_import_each_other() -> None:
    assert "cuda" in imported_packages("tiers"), "pinning comes from kvtier.cuda"
    assert "copy" not in imported_packages("tiers")


PRODUCT_PACKAGES = sorted(
    path.name
    for path in PACKAGE.iterdir()
    if (path / "__init__.py").exists() and path.name != "testing"
)


@pytest.mark.parametrize("package", PRODUCT_PACKAGES)
def test_product_packages_do_not_import_test_helpers(package: str) -> None:
    assert "testing" not in imported_packages(package)
