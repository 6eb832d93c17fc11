"""What a module of the checkout imports, read from its source: for the layering and cycle tests.

Every import statement counts, wherever it stands: at the top, inside a
function, under ``if TYPE_CHECKING:`` or in a ``try``. An import inside a
function runs later and one under ``TYPE_CHECKING`` never runs, but both say
the module depends on the other, which is what a layer rule is about.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "kvtier"


def module_name(path: Path) -> str:
    """The dotted name of a module: ``kvtier/config/__init__.py`` is ``kvtier.config``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """Every module of the ``kvtier`` package by name."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_in_source(source: str, modules: Collection[str] = ()) -> set[str]:
    """The modules that every import statement of ``source`` names.

    ``from X import Y`` names the module ``X.Y`` where that is one of ``modules``,
    else ``X``. Relative imports are not resolved (kvtier has none).
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return found


def imports_of(path: Path, modules: Collection[str] = ()) -> set[str]:
    """:func:`imports_in_source` of the file ``path``."""
    return imports_in_source(path.read_text(), modules)
