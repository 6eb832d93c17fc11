"""No test module imports another: what test modules share lives in conftest.py files."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO_ROOT

TEST_TREES = [REPO_ROOT / "tests", *sorted((REPO_ROOT / "plugins").glob("*/tests"))]


def module_name(path: Path) -> str:
    """``path``'s dotted module name, counted from the repository root."""
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)


def imported_modules(source: str, module: str) -> set[str]:
    """Every module and name that ``source``, the text of ``module``, imports, also inside
    functions, relative imports resolved; ``from a import b`` counts ``a`` and ``a.b``, since
    ``b`` may be a module."""
    package = module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            origin = ".".join([*base, *([node.module] if node.module else [])])
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names)
    return found


def test_no_test_module_imports_another() -> None:
    files = {module_name(path): path for tree in TEST_TREES for path in sorted(tree.rglob("*.py"))}
    test_modules = {name for name in files if name.rsplit(".", 1)[-1].startswith("test_")}
    assert __name__ in test_modules
    found = sorted(
        f"{importer} imports {imported}"
        for importer, path in files.items()
        for imported in imported_modules(path.read_text(), importer) & test_modules
    )
    assert not found, "move what they share into a conftest.py: " + "; ".join(found)


def test_every_form_of_import_is_seen() -> None:
    source = """
from tests.a.test_x import helper
from tests.a import test_y
import tests.test_z
def later():
    from .test_w import fixture
    from . import test_v
    from ..b.test_u import u
"""
    found = imported_modules(source, "tests.a.test_me")
    for module in ("x", "y", "w", "v"):
        assert f"tests.a.test_{module}" in found
    assert {"tests.test_z", "tests.b.test_u"} <= found
