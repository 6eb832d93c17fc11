"""What every test folder shares: where the checkout is, and loading a script of it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """Import a script that is not in a package (a benchmark, the docs hooks) by its path."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
