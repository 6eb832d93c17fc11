"""Base classes of every kvtier config model, light enough for any plugin module to import.

:mod:`kvtier.config` (the loader: sources, merging, error lines) builds on these;
plugins only need :class:`PluginConfig`, which :mod:`kvtier.api` exports.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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


@runtime_checkable
class NamesItsStore(Protocol):
    """A storage tier's config that names the store it writes (a disk tier: its directory).

    Two entries of the ``tiers`` list that name the same store are refused when
    the config is validated, as are two identical entries of any tier.
    """

    def store_name(self) -> str:
        """The store this entry writes, as a message shows it (no secrets)."""
        ...
