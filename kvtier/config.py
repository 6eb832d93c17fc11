"""Configuration: pydantic models validated once at start-up."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class KVTierModel(BaseModel):
    """Base of every kvtier config model: unknown keys are errors and values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PluginConfig(KVTierModel):
    """Base of a pluggable section's config; subclasses narrow ``type`` to ``Literal[name]``."""

    type: str = Field(description="Name of the registered implementation to use.")
