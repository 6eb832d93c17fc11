"""Documentation tests: every hook and config field is documented, the examples are valid, and
every page stays within its length."""

from __future__ import annotations

import ast
import inspect
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvtier import hookspecs
from kvtier.config import KVTierConfig, load_config
from kvtier.kinds import KINDS, STORAGE_TIER, Kind
from kvtier.offload.stats import FLUSH_COUNTERS
from kvtier.plugins import default_registry
from tests.conftest import REPO_ROOT, load_script

DOCS = REPO_ROOT / "docs"
EXAMPLE_PLUGIN = REPO_ROOT / "plugins" / "kvtier-example"


def load_docs_hooks() -> ModuleType:
    return load_script(DOCS / "hooks.py", "kvtier_docs_hooks")


def hook_specs() -> dict[str, list[str]]:
    return {
        name: list(inspect.signature(function).parameters)
        for name, function in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(function, "kvtier_spec")
    }


def test_there_are_hooks_to_document() -> None:
    assert "register_copy_backends" in hook_specs()


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_hook_is_documented_with_its_arguments(name: str) -> None:
    page = (DOCS / "plugin-hooks.md").read_text()
    arguments = ", ".join(hook_specs()[name])
    assert f"### `{name}({arguments})`" in page
    assert f"::: kvtier.hookspecs.{name}\n" in page


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_hook_section_names_the_factory_signature_and_what_it_builds(kind: Kind[Any]) -> None:
    page = (DOCS / "plugin-hooks.md").read_text()
    heading = f"### `{kind.hook}(register)`"
    section = page[page.index(heading) :].split("\n### ", 1)[0]
    assert f"[`{kind.factory.__name__}`](api.md#kvtier.kinds.{kind.factory.__name__})" in section
    if kind.builds is not object:
        assert f"[`{kind.builds.__name__}`](api.md#" in section


@pytest.fixture(scope="module")
def configuration_page() -> str:
    source = (DOCS / "configuration.md").read_text()
    hooks = load_docs_hooks()
    assert hooks.MARKER in source
    return str(hooks.on_page_markdown(source, page=None, config=None, files=None))


@pytest.mark.parametrize("field", sorted(KVTierConfig.model_fields))
def test_top_level_field_is_documented(field: str, configuration_page: str) -> None:
    description = KVTierConfig.model_fields[field].description
    assert description
    assert f"| `{field}` |" in configuration_page
    assert description in configuration_page


BUILTINS = [
    pytest.param(kind, name, id=f"{kind.section}-{name}")
    for kind in KINDS
    if kind.section is not None
    for name, reg in default_registry().of_kind(kind).items()
    if reg.distribution == "kvtier"
]


@pytest.mark.parametrize(("kind", "name"), BUILTINS)
def test_builtin_plugin_fields_are_documented(
    kind: Kind[Any], name: str, configuration_page: str
) -> None:
    section = kind.section
    model = default_registry().get(kind, name).config_model
    assert f"#### `{section}.type: {name}`" in configuration_page
    for field, info in model.model_fields.items():
        if field == "type":
            continue
        assert info.description, f"{model.__name__}.{field} has no description"
        assert f"| `{section}.{field}` |" in configuration_page
        assert info.description.replace("|", "\\|") in configuration_page


BUILTIN_TIERS = sorted(
    name
    for name, reg in default_registry().of_kind(STORAGE_TIER).items()
    if reg.distribution == "kvtier"
)


@pytest.mark.parametrize("name", BUILTIN_TIERS)
def test_builtin_storage_tier_fields_are_documented(name: str) -> None:
    registration = default_registry().get(STORAGE_TIER, name)
    source = (DOCS / "tiers.md").read_text()
    hooks = load_docs_hooks()
    assert hooks.TIERS_MARKER in source
    page = hooks.on_page_markdown(source, page=None, config=None, files=None)
    assert f"### `type: {name}`" in page
    for field, info in registration.config_model.model_fields.items():
        if field == "type":
            continue
        assert info.description, f"{registration.config_model.__name__}.{field} has no description"
        assert f"| `{field}` |" in page
        assert info.description.replace("|", "\\|") in page


@pytest.mark.parametrize("counter", FLUSH_COUNTERS, ids=lambda counter: counter.name)
def test_shutdown_counts_are_in_the_metrics_page(counter: Any) -> None:
    assert f"| `{counter.name}` | {counter.unit} |" in (DOCS / "metrics.md").read_text()


def test_every_command_is_in_the_command_line_page() -> None:
    source = (DOCS / "cli.md").read_text()
    hooks = load_docs_hooks()
    assert hooks.CLI_MARKER in source
    page = hooks.on_page_markdown(source, page=None, config=None, files=None)
    commands = ("plugins", "config validate", "config show", "config schema", "bench copy")
    for command in (*commands, "simulate"):
        assert f"## `kvtier {command}`" in page
        assert f"usage: kvtier {command}" in page


EXAMPLES = sorted(path.name for path in (DOCS / "examples").iterdir())


@pytest.mark.parametrize("name", EXAMPLES)
def test_documented_example_config_is_valid(name: str) -> None:
    config = load_config(env={}, config_file=DOCS / "examples" / name)
    assert set(config.sources().values()) >= {f"file {DOCS / 'examples' / name}"}


def test_example_plugin_imports_only_kvtier_api_from_kvtier() -> None:
    for file in sorted((EXAMPLE_PLUGIN / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name == "kvtier.api" or name.split(".")[0] != "kvtier", (file, name)


def test_tutorial_includes_every_file_of_the_example_plugin() -> None:
    tutorial = (DOCS / "writing-a-plugin.md").read_text()
    files = [EXAMPLE_PLUGIN / "pyproject.toml", *sorted(EXAMPLE_PLUGIN.rglob("*.py"))]
    for file in files:
        assert f'--8<-- "{file.relative_to(REPO_ROOT)}"' in tutorial


def test_quickstart_error_example_is_what_the_command_prints(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.cli import main

    page = (DOCS / "quickstart.md").read_text()
    example = re.search(
        r"\$ (KVTIER_\w+)=(\S+) kvtier (config validate [^\n]+)\n((?:[^$`\n][^\n]*\n)+)", page
    )
    assert example is not None, "the quick start shows no failing validate"
    name, value, command, shown = example.groups()
    for variable in [variable for variable in os.environ if variable.startswith("KVTIER_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv(name, value)
    monkeypatch.chdir(REPO_ROOT)
    assert main(command.split()) == 2
    assert capsys.readouterr().err == shown


MARKDOWN = sorted([REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *DOCS.rglob("*.md")])
_PARENT_PATH = re.compile(r"(?:\.\./)+[\w.\-/]*")


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_paths_that_climb_out_of_a_folder_name_files_of_the_repository(page: Path) -> None:
    for path in _PARENT_PATH.findall(page.read_text()):
        # A link resolves from the page's folder, a command from the repository root.
        found = [
            (base / path).resolve()
            for base in (page.parent, REPO_ROOT)
            if (base / path).resolve().is_relative_to(REPO_ROOT) and (base / path).exists()
        ]
        assert found, f"{page.name} names {path}, which is not a file of the repository"


def test_docs_build_config_resolves_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mkdocs_config = pytest.importorskip("mkdocs.config")
    monkeypatch.chdir(tmp_path)
    config = mkdocs_config.load_config(str(REPO_ROOT / "mkdocs.yml"))
    snippet_bases = config["mdx_configs"]["pymdownx.snippets"]["base_path"]
    assert [Path(base).resolve() for base in snippet_bases] == [REPO_ROOT]
    assert Path(config["docs_dir"]).resolve() == DOCS


PAGE_LINES = 300
PAGE_LINES_EXCEPTIONS = {"vllm.md": 350}
"""The most lines a docs page may have: a guide longer than that is split by subject. The vLLM
connector page gathers every key and behaviour of the connector in one place."""


@pytest.mark.parametrize(
    "page", sorted(DOCS.rglob("*.md")), ids=lambda page: page.relative_to(DOCS).as_posix()
)
def test_every_docs_page_is_within_its_length(page: Path) -> None:
    name = page.relative_to(DOCS).as_posix()
    bound = PAGE_LINES_EXCEPTIONS.get(name, PAGE_LINES)
    lines = len(page.read_text().splitlines())
    assert lines <= bound, f"docs/{name} has {lines} lines; split or trim it to {bound} at most"
