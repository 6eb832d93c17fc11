"""The size bounds the code keeps: no class over 500 lines, and the offload manager, the
hub every request passes through, at most 400."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.source_imports import PACKAGE

MAX_CLASS_LINES = 500
MAX_MANAGER_LINES = 400


def classes(tree: ast.Module) -> list[ast.ClassDef]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


@pytest.mark.parametrize(
    "module", sorted(PACKAGE.rglob("*.py")), ids=lambda path: str(path.relative_to(PACKAGE))
)
def test_no_class_is_over_its_bound(module: Path) -> None:
    tree = ast.parse(module.read_text(), filename=str(module))
    over = {
        node.name: node.end_lineno - node.lineno + 1
        for node in classes(tree)
        if node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    }
    assert not over, f"classes over {MAX_CLASS_LINES} lines: {over}; split them by job"


def test_the_offload_manager_is_within_its_bound() -> None:
    lines = len((PACKAGE / "offload" / "manager.py").read_text().splitlines())
    assert lines <= MAX_MANAGER_LINES, f"manager.py has {lines} lines"
