"""Base classes of every kvtier config model, light enough for any plugin module to import.

:mod:`kvtier.config` (the loader: sources, merging, error lines) builds on these;
plugins only need :class:`PluginConfig`, which :mod:`kvtier.api` exports.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class KVTierModel(BaseModel):
    """Base of every kvtier config model.

    Unknown keys are errors, values are immutable, and floats must be finite
    (``inf`` and ``nan`` are rejected, so no size or factor computed from one
    can overflow).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PluginConfig(KVTierModel):
    """Base of a pluggable section's config; subclasses narrow ``type`` to ``Literal[name]``."""

    type: str = Field(description="Name of the registered implementation to use.")
