"""The configuration reference: every config field of kvtier and its plugins, as Markdown.

Rendered from the config models themselves (type, default, description), so it
cannot drift from what :func:`kvtier.config.load_config` accepts. The docs
build puts it into the configuration page (``docs/hooks.py``) and
``kvtier config reference`` prints it.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvtier.config.model import SECTIONS, TIERS_FIELD, KVTierConfig
from kvtier.kinds import STORAGE_TIER
from kvtier.models import KVTierModel
from kvtier.plugins import Registry

_SECTION_FIELDS = {section.field: section for section in SECTIONS}


def render_config_reference(registry: Registry, *, distribution: str | None = None) -> str:
    """Render every config field as Markdown: the root fields, then each implementation's.

    Args:
        registry: The plugins whose config models to describe.
        distribution: Describe only implementations from this distribution
            (``"kvtier"`` for the built-ins); ``None`` describes all.

    Returns:
        Markdown with one table per model: key, type, default, description.
    """
    lines = ["## Top level", "", *_fields_table(KVTierConfig.model_fields, "")]
    for name, model in _nested_models().items():
        doc = " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())
        lines += ["", f"## `{name}`", "", doc, "", *_fields_table(model.model_fields, f"{name}.")]
    for section in SECTIONS:
        title = section.kind.title
        lines += [
            "",
            f"## `{section.field}`: {title}",
            "",
            f"{section.description} Pick one with `{section.field}.type`; "
            f"the default is `{section.default}`.",
        ]
        for reg in registry.of_kind(section.kind).values():
            if distribution is not None and reg.distribution != distribution:
                continue
            model = reg.config_model
            lines += ["", f"### `{section.field}.type: {reg.name}`", ""]
            doc = (model.__doc__ or "").strip()
            if doc:
                lines += [" ".join(doc.split("\n\n")[0].split()), ""]
            lines += _fields_table(model.model_fields, f"{section.field}.")
    lines += [
        "",
        f"## `{TIERS_FIELD}`: {STORAGE_TIER.title}s",
        "",
        f"{STORAGE_TIER.description} Each entry of the `{TIERS_FIELD}` list picks one with "
        "`type`; the entries' settings are in [Storage tiers](tiers.md#configuration).",
    ]
    return "\n".join(lines) + "\n"


def render_storage_tier_reference(registry: Registry, *, distribution: str | None = None) -> str:
    """Render each storage tier's config fields as Markdown, one table per tier.

    Args:
        registry: The plugins whose storage tiers to describe.
        distribution: Describe only tiers from this distribution; ``None`` describes all.

    Returns:
        Markdown with a ``### `type: <name>` `` heading and a fields table per tier.
    """
    lines: list[str] = []
    for reg in registry.of_kind(STORAGE_TIER).values():
        if distribution is not None and reg.distribution != distribution:
            continue
        model = reg.config_model
        lines += [f"### `type: {reg.name}`", ""]
        doc = (model.__doc__ or "").strip()
        if doc:
            lines += [" ".join(doc.split("\n\n")[0].split()), ""]
        fields = {name: info for name, info in model.model_fields.items() if name != "type"}
        lines += [*_fields_table(fields, ""), ""]
    return "\n".join(lines)


def _nested_models() -> dict[str, type[KVTierModel]]:
    """The top-level fields that hold a settings model of their own (not a plugin's)."""
    return {
        name: info.annotation
        for name, info in KVTierConfig.model_fields.items()
        if isinstance(info.annotation, type)
        and issubclass(info.annotation, KVTierModel)
        and name not in _SECTION_FIELDS
    }


def _fields_table(fields: dict[str, FieldInfo], prefix: str) -> list[str]:
    rows = ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for name, info in fields.items():
        if prefix and name == "type":
            continue
        description = (info.description or "").replace("|", "\\|").replace("\n", " ")
        is_section = not prefix and (name in _SECTION_FIELDS or name in _nested_models())
        if not prefix and name == TIERS_FIELD:
            type_text = "list of storage tiers (below)"
        else:
            type_text = "section (below)" if is_section else _type_name(info.annotation)
        default_text = _default_text(name, info)
        rows.append(f"| `{prefix}{name}` | {type_text} | {default_text} | {description} |")
    if len(rows) == 2:
        return ["No settings besides `type`."]
    return rows


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{value!r}`" for value in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "`None`"
    if isinstance(annotation, type):
        return f"`{annotation.__name__}`"
    return f"`{annotation}`"


def _default_text(name: str, info: FieldInfo) -> str:
    section = _SECTION_FIELDS.get(name)
    if section is not None:
        return f"`{section.default}`"
    if info.default is PydanticUndefined:
        if isinstance(info.annotation, type) and issubclass(info.annotation, KVTierModel):
            return "see below"
        return "required" if info.default_factory is None else "computed"
    return f"`{info.default!r}`"
