"""Loading a config: merge the sources, validate against the plugins, report every problem.

:func:`load_config` merges three sources, highest first:

1. explicit arguments (a dict; vLLM passes ``kv_connector_extra_config``),
2. ``KVTIER_*`` environment variables, nested with ``__``
   (``KVTIER_CPU_BYTES=16GiB``, ``KVTIER_COPY__TYPE=torch``),
3. a YAML, TOML or JSON file named by ``config_file`` (an argument or an explicit
   key) or by ``KVTIER_CONFIG``,

and validates the result against :func:`~kvtier.config.config_model` for the
registry it is given. Every problem becomes one line
``<source>: <dotted.path>: <message> (got <value>)`` of a
:class:`~kvtier.config.ConfigError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr, ValidationError

from kvtier.config.errors import ConfigError, Problem
from kvtier.config.model import (
    SECTIONS,
    SECTIONS_BY_FIELD,
    TIERS_FIELD,
    KVTierConfig,
    Section,
    section_shorthand,
)
from kvtier.config.schema import CODEC_FIELD, config_model
from kvtier.config.sources import (
    CONFIG_FILE_ENV,
    CONFIG_FILE_KEY,
    EXPLICIT_SOURCE,
    Layers,
    env_name_for,
    read_config_file,
    read_env,
    shape_problem,
)
from kvtier.kinds import RECORD_CODEC, STORAGE_TIER
from kvtier.models import KVTierModel

if TYPE_CHECKING:
    from kvtier.plugins import Registry


def load_config(
    explicit: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    registry: Registry | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> KVTierConfig:
    """Merge the config sources and validate them against the installed plugins.

    Sources, highest first: ``explicit``, ``KVTIER_*`` variables in ``env``,
    then the file named by ``config_file`` (this argument, else the
    ``config_file`` key of ``explicit``, else ``KVTIER_CONFIG``). When a higher
    source names a different ``type`` for a section, the lower sources'
    settings for that section are dropped.

    Args:
        explicit: Values given by the caller, e.g. vLLM's ``kv_connector_extra_config``.
        env: Environment variables; ``os.environ`` if ``None``.
        registry: Plugins to validate against; the process's default registry, loaded at
            this call, if ``None``.
        config_file: A YAML, TOML or JSON file, overriding any other way of naming one.

    Returns:
        A plain :class:`~kvtier.config.KVTierConfig` whose sections hold the
        plugins' own config instances; :meth:`KVTierConfig.source_of
        <kvtier.config.KVTierConfig.source_of>` tells where each value came from.

    Raises:
        ConfigError: Any source is invalid; one line per problem.
    """
    if registry is None:
        from kvtier.plugins import default_registry

        registry = default_registry()
    env = os.environ if env is None else env
    problems: list[Problem] = []
    explicit_problem = shape_problem(explicit, EXPLICIT_SOURCE, "(root)")
    if explicit_problem is not None:
        problems.append(explicit_problem)
        explicit = None
    explicit = dict(explicit or {})
    named_file = explicit.pop(CONFIG_FILE_KEY, None)
    layers = Layers()

    if config_file is not None:
        file_name, file_source = config_file, "argument config_file"
    elif named_file is not None:
        file_name, file_source = named_file, EXPLICIT_SOURCE
    elif env.get(CONFIG_FILE_ENV):
        file_name, file_source = env[CONFIG_FILE_ENV], f"env {CONFIG_FILE_ENV}"
    else:
        file_name, file_source = None, ""
    if file_name is not None:
        if not isinstance(file_name, (str, os.PathLike)):
            problems.append(
                Problem(file_source, CONFIG_FILE_KEY, "expected a file path", file_name)
            )
        else:
            try:
                file_values = read_config_file(file_name, file_source)
                layers.apply(file_values, lambda dotted: f"file {file_name}")
            except ConfigError as exc:
                problems.extend(exc.problems)

    env_values, env_names, env_problems = read_env(env)
    problems.extend(env_problems)
    layers.apply(env_values, lambda dotted: f"env {env_name_for(dotted, env_names)}")
    layers.apply(explicit, lambda dotted: EXPLICIT_SOURCE)

    for section in SECTIONS:
        given = layers.values.get(section.field)
        if isinstance(given, dict) and "type" not in given:
            given["type"] = section.default
    model = config_model(registry)
    try:
        validated = model.model_validate(layers.values)
    except ValidationError as exc:
        problems.extend(_problem_from_error(error, layers, registry) for error in exc.errors())
        raise ConfigError(problems) from None
    if problems:
        raise ConfigError(problems)
    # Each section now holds its plugin's own config instance, which a plain KVTierConfig keeps.
    config = KVTierConfig(**dict(validated))
    config._sources = dict(layers.sources)
    return config


def _problem_from_error(error: Mapping[str, Any], layers: Layers, registry: Registry) -> Problem:
    loc = tuple(error["loc"])
    # A tagged union puts the tag into the location; users never write it there.
    if len(loc) >= 2 and loc[0] in SECTIONS_BY_FIELD:
        given = layers.values.get(loc[0])
        if isinstance(given, Mapping) and loc[1] == given.get("type"):
            loc = (loc[0], *loc[2:])
    tier = _tier_entry(loc, layers.values)
    if tier is not None and len(loc) >= 3 and loc[2] == tier.get("type"):
        loc = (*loc[:2], *loc[3:])
    codec = _codec_entry(loc, tier)
    if codec is not None and len(loc) >= 4 and loc[3] == codec.get("type"):
        loc = (*loc[:3], *loc[4:])
    path = _dotted(loc)
    source = layers.source_of(loc)
    kind = error["type"]
    message = error["msg"]
    value = error.get("input")
    section = SECTIONS_BY_FIELD.get(str(loc[0])) if loc else None
    in_tiers = len(loc) == 2 and loc[0] == TIERS_FIELD
    at_codec = codec is not None and len(loc) == 3
    if kind == "union_tag_invalid" and at_codec:
        path = f"{path}.type"
        message = f"unknown {RECORD_CODEC.title} type; installed: {_codec_choices(registry)}"
        value = error["ctx"]["tag"]
    elif kind == "union_tag_not_found" and at_codec:
        message = (
            f"missing 'type'; installed {RECORD_CODEC.title} types: {_codec_choices(registry)}"
        )
    elif kind == "union_tag_invalid" and in_tiers:
        path = f"{path}.type"
        message = f"unknown {STORAGE_TIER.title} type; installed: {_tier_choices(registry)}"
        value = error["ctx"]["tag"]
    elif kind == "union_tag_not_found" and in_tiers:
        message = f"missing 'type'; installed {STORAGE_TIER.title} types: {_tier_choices(registry)}"
    elif kind == "union_tag_invalid" and section is not None:
        path = f"{section.field}.type"
        source = layers.source_of((section.field, "type"))
        message = f"unknown {section.kind.title} type; installed: {_choices(registry, section)}"
        value = error["ctx"]["tag"]
    elif kind == "union_tag_not_found" and section is not None:
        message = (
            f"missing 'type'; installed {section.kind.title} types: {_choices(registry, section)}"
        )
    elif kind == "extra_forbidden":
        allowed = _allowed_keys(registry, loc[:-1], layers.values)
        message = f"unknown key; valid keys here: {', '.join(allowed)}"
    elif kind == "missing":
        if section is not None and len(loc) == 1:
            message = (
                f"required: the default {section.kind.title} {section.default!r} is not "
                f"installed; set {section.field}.type to one of: {_choices(registry, section)}"
            )
        return Problem(source, path, message, has_value=False)
    elif message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if tier is not None and len(loc) == 3 and _is_secret(registry, tier, loc[2]):
        value = SECRET_MASK
    if loc == (TIERS_FIELD,) and isinstance(value, (list, tuple)):
        # The whole list: its entries' types, never their settings (a Redis URL's password).
        value = [entry.get("type") if isinstance(entry, Mapping) else entry for entry in value]
    return Problem(source, path, message, value)


SECRET_MASK = "**********"
"""What an error line shows instead of a secret setting's value (a Redis URL's password)."""


def _is_secret(registry: Registry, tier: Mapping[str, Any], name: Any) -> bool:
    registration = registry.of_kind(STORAGE_TIER).get(str(tier.get("type")))
    if registration is None:
        return False
    info = registration.config_model.model_fields.get(str(name))
    # A field kept out of repr (a key's name, where a key pasted by mistake would leak)
    # is kept out of errors too.
    return info is not None and (info.annotation is SecretStr or not info.repr)


def _dotted(loc: tuple[Any, ...]) -> str:
    """``("tiers", 0, "path")`` as ``tiers[0].path``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f"{'.' if path else ''}{part}"
    return path or "(root)"


def _tier_entry(loc: tuple[Any, ...], values: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The raw ``tiers`` entry ``loc`` points into, if it does."""
    if len(loc) < 2 or loc[0] != TIERS_FIELD or not isinstance(loc[1], int):
        return None
    entries = values.get(TIERS_FIELD)
    if not isinstance(entries, (list, tuple)) or not 0 <= loc[1] < len(entries):
        return None
    entry = entries[loc[1]]
    return entry if isinstance(entry, Mapping) else None


def _codec_entry(loc: tuple[Any, ...], tier: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The raw ``codec`` setting of a tier entry that ``loc`` points into, if it does."""
    if tier is None or len(loc) < 3 or loc[2] != CODEC_FIELD:
        return None
    given = section_shorthand(tier.get(CODEC_FIELD))
    return given if isinstance(given, Mapping) else None


def _codec_choices(registry: Registry) -> str:
    return ", ".join(sorted(registry.of_kind(RECORD_CODEC))) or "none"


def _tier_choices(registry: Registry) -> str:
    return ", ".join(sorted(registry.of_kind(STORAGE_TIER))) or "none"


def _choices(registry: Registry, section: Section) -> str:
    return ", ".join(sorted(registry.of_kind(section.kind))) or "none"


def _allowed_keys(
    registry: Registry, parent: tuple[Any, ...], values: Mapping[str, Any]
) -> list[str]:
    if not parent:
        return sorted(KVTierConfig.model_fields)
    tier = _tier_entry(parent, values)
    codec = _codec_entry(parent, tier)
    if codec is not None and len(parent) == 3:
        registered_codecs = registry.of_kind(RECORD_CODEC)
        if codec.get("type") in registered_codecs:
            return sorted(registered_codecs[codec["type"]].config_model.model_fields)
    if tier is not None and len(parent) == 2:
        registered = registry.of_kind(STORAGE_TIER)
        if tier.get("type") in registered:
            return sorted(registered[tier["type"]].config_model.model_fields)
    section = SECTIONS_BY_FIELD.get(str(parent[0]))
    if len(parent) == 1 and section is not None:
        given = values.get(section.field)
        name = given.get("type", section.default) if isinstance(given, Mapping) else section.default
        registered = registry.of_kind(section.kind)
        if name in registered:
            return sorted(registered[name].config_model.model_fields)
    nested = KVTierConfig.model_fields.get(str(parent[0]))
    if len(parent) == 1 and nested is not None and isinstance(nested.annotation, type):
        if issubclass(nested.annotation, KVTierModel):
            return sorted(nested.annotation.model_fields)
    return ["(see kvtier config schema)"]
