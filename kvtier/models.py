"""Base classes of every kvtier config model, light enough for any plugin module to import.

:mod:`kvtier.config` (the loader: sources, merging, error lines) builds on these;
plugins only need :class:`PluginConfig`, which :mod:`kvtier.api` exports.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class KVTierModel(BaseModel):
    """Base of every kvtier config model: unknown keys are errors and values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PluginConfig(KVTierModel):
    """Base of a pluggable section's config; subclasses narrow ``type`` to ``Literal[name]``."""

    type: str = Field(description="Name of the registered implementation to use.")
