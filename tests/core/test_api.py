"""The plugin author's module and the config path stay light: no torch, no numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

HEAVY = ("torch", "numpy")


def modules_after(code: str) -> set[str]:
    """Run ``code`` in a fresh interpreter, built-in plugins only; return what it imported."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "KVTIER_LOAD_PLUGINS": "",
    }
    result = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(list(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env=env,
    )
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_api_imports_neither_torch_nor_numpy() -> None:
    imported = modules_after("import kvtier.api")
    assert "kvtier.api" in imported
    assert imported.isdisjoint(HEAVY)
    assert "kvtier.config" not in imported, "kvtier.api must not import the config loader"


def test_listing_plugins_and_validating_a_config_import_no_implementation() -> None:
    imported = modules_after(
        "from kvtier.cli import main\n"
        "assert main(['plugins']) == 0\n"
        "assert main(['config', 'validate', 'docs/examples/kvtier.yaml', '--no-memory-check']) == 0"
    )
    assert "kvtier.plugins" in imported
    assert imported.isdisjoint(HEAVY)
    implementations = {
        "kvtier.copy.torch_backend",
        "kvtier.layout.resolvers",
        "kvtier.tiers.base",
        "kvtier.tiers.queued",
        "kvtier.tiers.disk",
        "kvtier.tiers.redis",
        "kvtier.tiers.s3",
    }
    assert imported.isdisjoint(implementations)
