"""Policies to replay: ``NAME:KEY=VALUE`` specs and policy files, checked like the config.

A spec is ``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE...]``, quoting a value that
holds ``,``, ``:`` or ``=``; a policy file (JSON or YAML) lists more. Their
settings are checked as the config checker checks the ``index`` section, with
the same one-line errors.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import ConfigError, load_config
from kvtier.config.sources import MAX_CONFIG_FILE_BYTES, read_config_file
from kvtier.models import PluginConfig


class PolicyError(ValueError):
    """A policy spec or policy file is invalid; the message says which and why."""


@dataclass(frozen=True)
class PolicySpec:
    """A policy to replay: its label in the results and its validated config."""

    label: str
    config: PluginConfig


QUOTES = "'\""


def split_unquoted(text: str, separator: str, what: str) -> list[str]:
    """Split ``text`` at each ``separator`` outside single or double quotes; quotes are kept.

    Raises:
        PolicyError: A quote is not closed; ``what`` names the text in the message.
    """
    parts, current, quote = [], [], ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in QUOTES:
            quote = char
        elif char == separator:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    if quote:
        raise PolicyError(
            f"{what}: the quote {quote} is not closed; close it, or give the value in --policy-file"
        )
    parts.append("".join(current))
    return parts


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in QUOTES:
        return value[1:-1]
    return value


def _quote(value: Any) -> str:
    text = str(value)
    if not any(char in text for char in ",:=" + QUOTES):
        return text
    return f"'{text}'" if "'" not in text else f'"{text}"'


def validate_policy(name: str, settings: Mapping[str, Any], source: str) -> PluginConfig:
    """Validate a policy's settings as the config checker validates the ``index`` section.

    Args:
        name: A registered block index (or eviction policy).
        settings: Settings that replace its defaults.
        source: Where they came from, in place of the config checker's source in errors.

    Raises:
        PolicyError: One config-checker line per problem (``source: index.KEY: ... (got ...)``).
    """
    try:
        config = load_config({"index": {**settings, "type": name}}, env={})
    except ConfigError as exc:
        problems = [dataclasses.replace(problem, source=source) for problem in exc.problems]
        raise PolicyError("\n".join(str(problem) for problem in problems)) from None
    return config.index


def parse_policy(spec: str) -> PolicySpec:
    """A ``--policies`` entry: ``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE...]``.

    A value in single or double quotes may hold any character but its quote.

    Raises:
        PolicyError: A setting is malformed or the policy's config model rejects it.
    """
    name, *settings = split_unquoted(spec, ":", f"policy {spec!r}")
    values: dict[str, str] = {}
    for setting in settings:
        key, equals, value = setting.partition("=")
        if not equals or not key:
            raise PolicyError(f"policy {spec!r}: settings are KEY=VALUE, got {setting!r}")
        values[key] = _unquote(value)
    return PolicySpec(spec, validate_policy(name, values, f"--policies {spec!r}"))


def read_policy_file(path: str) -> list[PolicySpec]:
    """The policies of a JSON (``.json``) or YAML (``.yaml``, ``.yml``) file.

    The file holds ``{"policies": [...]}``; each entry is a policy name, or a
    mapping with ``type`` and settings, like the ``index`` config section. An
    entry is labelled ``NAME:KEY=VALUE...`` in the results.

    Raises:
        PolicyError: The file cannot be read or parsed, or an entry is invalid.
    """
    try:
        if Path(path).suffix.lower() == ".json":
            text = _read_bounded(path)
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise PolicyError(f"--policy-file {path}: not JSON: {exc}") from None
        else:
            data = read_config_file(path, f"--policy-file {path}")
    except ConfigError as exc:
        raise PolicyError("\n".join(exc.lines)) from None
    entries = data.get("policies") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise PolicyError(
            f"--policy-file {path}: expected a mapping with a non-empty 'policies' list, "
            'e.g. {"policies": ["lru", {"type": "prefix_arc", "history_factor": 8}]}'
        )
    specs = []
    for position, entry in enumerate(entries):
        source = f"--policy-file {path} policies[{position}]"
        if isinstance(entry, str):
            specs.append(PolicySpec(entry, validate_policy(entry, {}, source)))
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
            raise PolicyError(f"{source}: expected a policy name or a mapping with 'type'")
        settings = {key: value for key, value in entry.items() if key != "type"}
        label = ":".join(
            [entry["type"], *(f"{key}={_quote(value)}" for key, value in settings.items())]
        )
        specs.append(PolicySpec(label, validate_policy(entry["type"], settings, source)))
    return specs


def _read_bounded(path: str) -> str:
    with open(path, "rb") as file:
        data = file.read(MAX_CONFIG_FILE_BYTES + 1)
    if len(data) > MAX_CONFIG_FILE_BYTES:
        raise PolicyError(f"--policy-file {path}: larger than {MAX_CONFIG_FILE_BYTES} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise PolicyError(f"--policy-file {path}: not UTF-8 text") from None
