"""The published JSON Schema accepts exactly what the loader accepts, in standard keywords only.

Checked with the ``jsonschema`` package on every kvtier config shown in the docs
(YAML, TOML and JSON blocks, included example files, and the
``kv_connector_extra_config`` of every ``--kv-transfer-config`` command) and on
the bad configs of the config tests: for each, the schema's verdict is the
loader's.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
import yaml
from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from kvtier.config import (
    CONFIG_FILE_KEY,
    ConfigError,
    KVTierConfig,
    config_json_schema,
    load_config,
    read_config_file,
)
from kvtier.config.schema import JSON_SCHEMA_DIALECT, StandardJsonSchema
from kvtier.plugins import Registry, build_plugin_manager, collect, default_registry
from tests.config.conftest import (
    BAD_EXPLICIT,
    BAD_FILES,
    FLOAT_FILES,
    LONG_VALUES,
    NATIVE_BOUNDS,
    NOT_POSITIVE_SIZES,
    Sections,
    make_registry,
)
from tests.conftest import REPO_ROOT

DOC_PAGES = sorted((REPO_ROOT / "docs").rglob("*.md")) + [REPO_ROOT / "README.md"]
PARSERS: dict[str, Callable[[str], Any]] = {
    "yaml": yaml.safe_load,
    "yml": yaml.safe_load,
    "toml": tomllib.loads,
    "json": json.loads,
}
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"\s*$')
KV_TRANSFER_CONFIG = re.compile(r"--kv-transfer-config\s+'([^']+)'")

# Every keyword of JSON Schema draft 2020-12 (core, applicator, validation, meta-data, format,
# content and unevaluated vocabularies).
STANDARD_KEYWORDS = frozenset(
    """$schema $id $ref $anchor $dynamicRef $dynamicAnchor $vocabulary $comment $defs
    allOf anyOf oneOf not if then else dependentSchemas prefixItems items contains properties
    patternProperties additionalProperties propertyNames unevaluatedItems
    unevaluatedProperties type const enum multipleOf maximum exclusiveMaximum minimum
    exclusiveMinimum maxLength minLength pattern maxItems minItems uniqueItems maxContains
    minContains maxProperties minProperties required dependentRequired title description
    default deprecated readOnly writeOnly examples format contentEncoding contentMediaType
    contentSchema""".split()
)
# Where a keyword's value is a map of names to schemas, or a list of schemas.
NAMED_SCHEMAS = {"$defs", "properties", "patternProperties", "dependentSchemas"}
SCHEMA_LISTS = {"allOf", "anyOf", "oneOf", "prefixItems"}
SCHEMA_VALUES = {
    "not", "if", "then", "else", "items", "contains", "additionalProperties", "propertyNames",
    "unevaluatedItems", "unevaluatedProperties", "contentSchema",
}  # fmt: skip


def builtin_registry() -> Registry:
    """The built-in plugins alone, as the reliability tests' subprocesses load them."""
    return collect(build_plugin_manager({"KVTIER_LOAD_PLUGINS": ""}))


def doc_configs() -> Iterator[tuple[str, Any]]:
    """Every kvtier config the docs show, named by page and position."""
    fields = set(KVTierConfig.model_fields)
    for page in DOC_PAGES:
        text = page.read_text()
        name = page.relative_to(REPO_ROOT)
        for match in FENCE.finditer(text):
            language, body = match.group(1).lower(), match.group(2)
            if language not in PARSERS:
                continue
            included = SNIPPET.match(body.strip())
            if included:
                body = (REPO_ROOT / included.group(1)).read_text()
            data = PARSERS[language](body)
            if isinstance(data, dict) and fields & set(data):
                line = text.count("\n", 0, match.start()) + 1
                yield f"{name}:{line}", data
        for match in KV_TRANSFER_CONFIG.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            transfer = json.loads(match.group(1))
            # Another connector's extra config (vLLM's own offloading) is not a kvtier config.
            if transfer["kv_connector"] != "KVTierConnector":
                continue
            extra = transfer["kv_connector_extra_config"]
            # A file the extra config names is read as a file; the key itself is no setting.
            extra.pop(CONFIG_FILE_KEY, None)
            if extra:
                yield f"{name}:{line} kv_connector_extra_config", extra


def parsed(text: str, suffix: str, tmp_path: Path) -> Any:
    """A config file's document as the loader reads it, or ``None`` where it reads none."""
    file = tmp_path / f"case{suffix}"
    file.write_text(text)
    try:
        return read_config_file(file, "test")
    except ConfigError:
        return None


def bad_configs() -> Iterator[tuple[str, Callable[[], Registry], str | dict[str, Any], str]]:
    """The bad configs of the config tests: (name, registry, document or text, file suffix)."""
    for case, given in BAD_EXPLICIT.items():
        plugins = () if case == "no plugin installed" else (Sections(),)
        yield f"test_config {case}", lambda plugins=plugins: make_registry(*plugins), given, ""
    for case, (make, _) in LONG_VALUES.items():
        yield f"test_config {case}", lambda: make_registry(Sections()), {"bogus": make()}, ""
    for _, name, field, value in NATIVE_BOUNDS:
        given = {"copy": {"type": name, field: value}}
        yield f"test_config {name}.{field}", builtin_registry, given, ""
    for case, (text, _) in BAD_FILES.items():
        yield f"test_cli {case}", lambda: make_registry(Sections()), text, ".yaml"
    # test_config_inputs.py's FILES are refused while the file is read: no document for a schema.
    for case, (name, content) in FLOAT_FILES.items():
        yield f"test_config_inputs floats {case}", builtin_registry, content, Path(name).suffix
    sizes = NOT_POSITIVE_SIZES
    yield "test_config_inputs sizes", builtin_registry, sizes, ".yaml"


def as_json(document: Any) -> Any | None:
    """``document`` as JSON has it, or ``None`` where JSON cannot hold it (``inf``, dates)."""
    try:
        return json.loads(json.dumps(document, allow_nan=False))
    except (TypeError, ValueError):
        return None


def verdicts(document: Any, registry: Registry) -> tuple[bool, bool | None]:
    """(the loader accepts ``document``, the schema accepts it or ``None`` if not JSON)."""
    try:
        load_config(document, env={}, registry=registry)
        loaded = True
    except ConfigError:
        loaded = False
    as_data = as_json(document)
    if as_data is None:
        return loaded, None
    return loaded, Draft202012Validator(config_json_schema(registry)).is_valid(as_data)


def keywords(schema: Any, where: str = "#") -> Iterator[tuple[str, str]]:
    """Every keyword used in ``schema`` and where, walking only schema positions."""
    if not isinstance(schema, dict):
        return
    for keyword, value in schema.items():
        yield keyword, where
        if keyword in NAMED_SCHEMAS:
            for name, child in value.items():
                yield from keywords(child, f"{where}/{keyword}/{name}")
        elif keyword in SCHEMA_LISTS:
            for index, child in enumerate(value):
                yield from keywords(child, f"{where}/{keyword}/{index}")
        elif keyword in SCHEMA_VALUES:
            yield from keywords(value, f"{where}/{keyword}")


@pytest.mark.parametrize(
    "registry", [default_registry, lambda: make_registry(Sections())], ids=["installed", "test"]
)
def test_schema_is_valid_and_uses_only_standard_keywords(
    registry: Callable[[], Registry],
) -> None:
    schema = config_json_schema(registry())
    assert schema["$schema"] == JSON_SCHEMA_DIALECT
    assert validator_for(schema) is Draft202012Validator
    Draft202012Validator.check_schema(schema)
    used = dict(keywords(schema))
    assert {
        keyword: where for keyword, where in used.items() if keyword not in STANDARD_KEYWORDS
    } == {}


DOC_CONFIGS = dict(doc_configs())


def test_the_docs_show_configs() -> None:
    pages = {name.split(":")[0] for name in DOC_CONFIGS}
    assert {"README.md", "docs/configuration.md", "docs/vllm.md", "docs/quickstart.md"} <= pages


@pytest.mark.parametrize("name", sorted(DOC_CONFIGS))
def test_every_config_in_the_docs_is_valid_to_the_loader_and_the_schema(name: str) -> None:
    assert verdicts(DOC_CONFIGS[name], default_registry()) == (True, True)


BAD_CONFIGS = {name: (registry, given, suffix) for name, registry, given, suffix in bad_configs()}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_every_bad_config_of_the_tests_is_refused_by_the_loader_and_the_schema(
    name: str, tmp_path: Path
) -> None:
    registry, given, suffix = BAD_CONFIGS[name]
    document = parsed(given, suffix, tmp_path) if isinstance(given, str) else given
    if document is None:
        pytest.skip("refused while reading the file: there is no document to check")
    loaded, matched = verdicts(document, registry())
    assert loaded is False
    assert matched in (False, None)  # None: JSON cannot hold it, and the loader refused it


SHORTHANDS: dict[str, tuple[dict[str, Any], bool]] = {
    "section as its type": ({"copy": "twin", "index": "lru"}, True),
    "section without type": ({"copy": {"streams": 2}}, True),
    "unknown type name": ({"copy": "turbo"}, False),
    "settings of another type without type": ({"copy": {"depth": 2}}, False),
    "empty section": ({"layout": {}}, True),
    "section as a number": ({"copy": 3}, False),
    "section as null": ({"copy": None}, False),
    "decimal size": ({"cpu_bytes": "1.5GiB"}, True),
    "short unit": ({"cpu_bytes": "64G"}, True),
    "lower case unit": ({"cpu_bytes_per_rank": "500mb"}, True),
    "size with spaces": ({"cpu_bytes": " 2 GiB "}, True),
    "plain number as a string": ({"cpu_bytes": "4096"}, True),
    "largest size": ({"cpu_bytes": 2**63 - 1}, True),
    "size too large": ({"cpu_bytes": 2**63}, False),
    "size in bits": ({"cpu_bytes": "8Gbit"}, False),
    "text after the unit": ({"cpu_bytes": "8GiB of it"}, False),
    "dot before the unit": ({"cpu_bytes": "1.GB"}, False),
    "zero with a unit": ({"cpu_bytes": "0.0GiB"}, False),
    "size as a float": ({"cpu_bytes": 1.5}, False),
    "size as a boolean": ({"cpu_bytes": True}, False),
    "no size at all": ({"cpu_bytes": "GiB"}, False),
    "null per-rank size": ({"cpu_bytes_per_rank": None}, True),
    "unknown key": ({"cpu_bytez": 1}, False),
}


@pytest.mark.parametrize("case", sorted(SHORTHANDS))
def test_schema_and_loader_agree_on_shorthands_and_sizes(case: str) -> None:
    document, accepted = SHORTHANDS[case]
    assert verdicts(document, make_registry(Sections())) == (accepted, accepted)


class Apple(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["apple"] = "apple"
    seeds: int = 0


class Pear(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["pear"] = "pear"


class Basket(BaseModel):
    fruit: list[Annotated[Apple | Pear, Field(discriminator="kind")]]


@pytest.mark.parametrize(
    ("fruit", "accepted"),
    [([{"kind": "apple", "seeds": 3}, {"kind": "pear"}], True), ([{"seeds": 3}], False)],
)
def test_a_tagged_union_needs_its_tag_in_the_schema_as_in_pydantic(
    fruit: list[dict[str, Any]], accepted: bool
) -> None:
    schema = Basket.model_json_schema(schema_generator=StandardJsonSchema)
    assert "discriminator" not in json.dumps(schema)
    validated = Draft202012Validator(schema).is_valid({"fruit": fruit})
    try:
        Basket.model_validate({"fruit": fruit})
        loaded = True
    except ValidationError:
        loaded = False
    assert (loaded, validated) == (accepted, accepted)


def test_a_float_json_cannot_hold_is_refused_by_the_loader() -> None:
    assert verdicts(
        {"index": {"type": "prefix_arc", "history_factor": math.inf}}, builtin_registry()
    ) == (False, None)
