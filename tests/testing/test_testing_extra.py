"""The plugin authors' kit: the contract suites alone, importing only what kvtier and its
``testing`` extra install, and saying which extra to install when that is missing."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.source_imports import PACKAGE, imports_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@pytest.mark.parametrize("dependency", ["pytest", "hypothesis"])
def test_a_missing_dependency_names_the_testing_extra(
    dependency: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "kvtier.testing", raising=False)
    monkeypatch.setitem(sys.modules, dependency, None)  # what an import then finds: no module
    with pytest.raises(ImportError, match=r"pip install 'kvtier\[testing\]'") as caught:
        importlib.import_module("kvtier.testing")
    assert caught.value.name == dependency


def requirement_names(requirements: list[str]) -> set[str]:
    """The distribution names of ``requirements``, as import names (``moto[server]>=5``: moto)."""
    return {re.match(r"[A-Za-z0-9_.-]+", req)[0].lower().replace("-", "_") for req in requirements}


def test_the_kit_holds_the_contract_suites_and_imports_what_the_testing_extra_installs() -> None:
    kit = sorted((PACKAGE / "testing").glob("*.py"))
    assert [p.name for p in kit if not p.name.startswith("contracts_")] == ["__init__.py"]
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    installed = requirement_names(project["dependencies"]) | requirement_names(
        project["optional-dependencies"]["testing"]
    )
    imported = {name.split(".")[0] for path in kit for name in imports_of(path)}
    third_party = imported - set(sys.stdlib_module_names) - {"__future__", "kvtier"}
    assert {"pytest", "hypothesis", "torch"} <= third_party
    assert sorted(third_party - installed) == []
