"""The validating schema: :class:`KVTierConfig`'s fields with each section narrowed to a plugin's.

:func:`config_model` builds, for one registry, a model whose pluggable sections
are discriminated unions (on ``type``) of the config models the registry's
plugins registered. :func:`~kvtier.config.load_config` validates with it; the
configs it returns are plain :class:`~kvtier.config.KVTierConfig` instances.
:func:`config_json_schema` is its JSON Schema, as ``kvtier config schema`` publishes it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import AfterValidator, Field, create_model, field_validator
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from kvtier.config.bounds import MAX_TIERS
from kvtier.config.model import (
    COPY_SHADOWS,
    SECTIONS,
    TIERS_DESCRIPTION,
    TIERS_FIELD,
    KVTierConfig,
    RootSettings,
    Section,
    section_shorthand,
)
from kvtier.kinds import RECORD_CODEC, STORAGE_TIER
from kvtier.models import NamesItsStore, PluginConfig

if TYPE_CHECKING:
    from kvtier.plugins import Registry

_MODELS: dict[int, tuple[Registry, type[RootSettings]]] = {}


def config_model(registry: Registry | None = None) -> type[RootSettings]:
    """Return the model that validates a config against ``registry``'s plugins.

    It has :class:`~kvtier.config.KVTierConfig`'s fields, each pluggable
    section a discriminated union (on ``type``) of the config models registered
    for its kind; a section's default is its default implementation when that
    is registered, else the section is required. Each entry of ``tiers`` is a
    discriminated union of the registered storage tiers' models.

    Args:
        registry: The plugins to validate against; the process's default
            registry, loaded at this call, if ``None``.

    Returns:
        A model class whose JSON schema includes every plugin's config model.
    """
    if registry is None:
        from kvtier.plugins import default_registry

        registry = default_registry()
    cached = _MODELS.get(id(registry))
    if cached is not None and cached[0] is registry:
        return cached[1]
    fields: dict[str, Any] = {}
    for section in SECTIONS:
        registered = registry.of_kind(section.kind)
        models = tuple(reg.config_model for reg in registered.values())
        if models:
            annotation: Any = Annotated[Union[models], Field(discriminator="type")]  # noqa: UP007
        else:
            annotation = Annotated[PluginConfig, AfterValidator(_no_implementation(section))]
        if section.default in registered:
            default = Field(
                default_factory=registered[section.default].config_model,
                description=section.description,
            )
        else:
            default = Field(description=section.description)
        fields[section.field] = (annotation, default)
    codec = _codec_union(registry)
    tier_models = tuple(
        _with_codec(reg.config_model, codec) for reg in registry.of_kind(STORAGE_TIER).values()
    )
    tier: Any = (
        Annotated[Union[tier_models], Field(discriminator="type")]  # noqa: UP007
        if tier_models
        else Annotated[PluginConfig, AfterValidator(_no_storage_tier)]
    )
    fields[TIERS_FIELD] = (
        tuple[tier, ...],
        Field((), max_length=MAX_TIERS, description=TIERS_DESCRIPTION),
    )
    shorthand = field_validator(*(section.field for section in SECTIONS), mode="before")(_shorthand)
    one_entry_per_store = field_validator(TIERS_FIELD)(_one_entry_per_store)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=COPY_SHADOWS, category=UserWarning)
        model: type[RootSettings] = create_model(
            "KVTierConfig",
            __base__=RootSettings,
            __doc__=KVTierConfig.__doc__,
            __module__=__name__,
            __validators__={
                "section_shorthand": shorthand,
                "one_entry_per_store": one_entry_per_store,
            },
            **fields,
        )
    _MODELS[id(registry)] = (registry, model)
    return model


def _shorthand(cls: type[RootSettings], value: Any) -> Any:
    return section_shorthand(value)


CODEC_FIELD = "codec"
"""The field of a storage tier's config that names its record codec."""


def _codec_union(registry: Registry) -> tuple[Any, Any]:
    """What a tier's ``codec`` is once validated (one of the registered codecs' models, or
    null), and what a config may give for it (a codec's name too)."""
    models = tuple(reg.config_model for reg in registry.of_kind(RECORD_CODEC).values())
    if not models:
        return Annotated[PluginConfig, AfterValidator(_no_codec)] | None, Any
    union = Annotated[Union[models], Field(discriminator="type")]  # noqa: UP007
    # What a file may hold: also a codec's name alone (``codec: fp8``).
    names = Literal[tuple(reg.name for reg in registry.of_kind(RECORD_CODEC).values())]  # type: ignore[valid-type]
    return union | None, Union[names, union, None]  # noqa: UP007


def _with_codec(model: type[PluginConfig], codec: tuple[Any, Any]) -> type[PluginConfig]:
    """``model`` with its ``codec`` field (if it has one) checked against the registered codecs."""
    if CODEC_FIELD not in model.model_fields:
        return model
    described = model.model_fields[CODEC_FIELD]
    validated, given = codec
    shorthand = field_validator(CODEC_FIELD, mode="before", json_schema_input_type=given)
    return create_model(
        model.__name__,
        __base__=model,
        __doc__=model.__doc__,
        __module__=model.__module__,
        # Overrides the base's validator of the same name, which keeps a mapping unvalidated.
        __validators__={"_plain_codec": shorthand(_shorthand)},
        **{CODEC_FIELD: (validated, Field(None, description=described.description))},
    )


def _no_codec(value: Any) -> Any:
    raise ValueError(f"no {RECORD_CODEC.title} is installed; install a plugin that provides one")


def _one_entry_per_store(
    cls: type[RootSettings], tiers: tuple[PluginConfig, ...]
) -> tuple[PluginConfig, ...]:
    """Refuse two entries that write the same store: naming one store, or identical."""
    for position, entry in enumerate(tiers):
        for first, earlier in enumerate(tiers[:position]):
            if _store_name(entry) is not None and _store_name(entry) == _store_name(earlier):
                how = f"the same store ({_store_name(entry)}) as"
            elif entry == earlier:
                how = "the same settings as"
            else:
                continue
            raise ValueError(
                f"tiers[{position}] has {how} tiers[{first}]; list each store once: remove "
                "one entry, or point it at another store"
            )
    return tiers


def _store_name(entry: PluginConfig) -> str | None:
    return f"{entry.type} {entry.store_name()}" if isinstance(entry, NamesItsStore) else None


def _no_storage_tier(value: Any) -> Any:
    raise ValueError(
        f"no {STORAGE_TIER.title} is installed; install a plugin that provides one, or remove "
        "the entry"
    )


def _no_implementation(section: Section) -> Callable[[Any], Any]:
    def reject(value: Any) -> Any:
        raise ValueError(
            f"no {section.kind.title} is installed; install a plugin that provides one"
        )

    return reject


JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def config_json_schema(registry: Registry | None = None) -> dict[str, Any]:
    """Return the JSON Schema of a config file for ``registry``'s plugins, in standard keywords.

    It accepts what :func:`~kvtier.config.load_config` accepts from a file,
    shorthands included: a section given as a type name (``copy: torch``) or as
    a mapping without ``type`` (the section's default implementation), and
    sizes with a unit (``"1.5GiB"``). A size string's form is checked; the
    value it stands for (at least one byte, at most a signed 64-bit count) is
    checked on loading. ``config_file``, which names a file among explicit
    values, is not a key of a file.

    Args:
        registry: The plugins to describe; the process's default registry, loaded at this
            call, if ``None``.

    Returns:
        A JSON Schema (draft 2020-12) as a dict.
    """
    if registry is None:
        from kvtier.plugins import default_registry

        registry = default_registry()
    schema = config_model(registry).model_json_schema(schema_generator=StandardJsonSchema)
    properties = schema["properties"]
    for section in SECTIONS:
        described = properties[section.field]
        annotations = {key: described[key] for key in ("title", "description") if key in described}
        accepted = _section_schema(section, registry, described, schema.get("$defs", {}))
        properties[section.field] = {**annotations, **accepted}
    return {"$schema": JSON_SCHEMA_DIALECT, **schema}


def _section_schema(
    section: Section, registry: Registry, described: dict[str, Any], defs: dict[str, Any]
) -> dict[str, Any]:
    """What a section accepts: a type name, a mapping with ``type``, or one without it."""
    by_type = described.get("oneOf")
    if by_type is None:  # no implementation installed: nothing is accepted
        return {"not": {}}
    accepted: list[dict[str, Any]] = [{"type": "object", "required": ["type"], "oneOf": by_type}]
    registered = registry.of_kind(section.kind)
    names = [name for name, reg in registered.items() if _settings_optional(reg.config_model)]
    if names:
        accepted.insert(0, {"type": "string", "enum": names})
    refs = {
        defs[choice["$ref"].rsplit("/", 1)[-1]]["properties"]["type"]["const"]: choice["$ref"]
        for choice in by_type
    }
    if section.default in refs:
        accepted.append(
            {"type": "object", "not": {"required": ["type"]}, "$ref": refs[section.default]}
        )
    return {"anyOf": accepted}


def _settings_optional(model: type[PluginConfig]) -> bool:
    return not any(field.is_required() for field in model.model_fields.values())


class StandardJsonSchema(GenerateJsonSchema):
    """Pydantic's JSON Schema without its one non-standard keyword, ``discriminator``.

    A tagged union says instead, in standard keywords, what pydantic checks: the
    value is a mapping that has the tag (each choice's schema holds the tag's value).
    """

    def tagged_union_schema(self, schema: core_schema.TaggedUnionSchema) -> JsonSchemaValue:
        generated = super().tagged_union_schema(schema)
        discriminator = generated.pop("discriminator", None)
        if discriminator is not None:
            generated.update(type="object", required=[discriminator["propertyName"]])
        return generated
