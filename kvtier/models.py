"""Base classes of every kvtier config model, light enough for any plugin module to import.

:mod:`kvtier.config` (the loader: sources, merging, error lines) builds on these;
plugins only need :class:`PluginConfig`, which :mod:`kvtier.api` exports.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field


class KVTierModel(BaseModel):
    """Base of every kvtier config model.

    Unknown keys are errors, values are immutable, and floats must be finite
    (``inf`` and ``nan`` are rejected, so no size or factor computed from one
    can overflow).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


WritePolicy = Literal["write_through", "write_through_admitted", "write_back"]
"""When blocks of the host tier are written to a storage tier below it:

- ``write_through``: every block stored in the host tier, as soon as its store completed;
- ``write_through_admitted``: a block the first time the host tier serves it again (a host
  hit the engine loads), as soon as that load is planned: only reused blocks reach the tier;
- ``write_back``: a block when the host tier evicts it, and on a graceful shutdown every
  block still in the host tier that the tier lacks.
"""


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


@runtime_checkable
class HasWritePolicy(Protocol):
    """A storage tier's config that says when host-tier blocks are written to it.

    A tier whose config has no ``write_policy`` is written back (on eviction and
    on a graceful shutdown).
    """

    write_policy: WritePolicy


def write_policy_of(config: object) -> WritePolicy:
    """The write policy of a storage tier's config: its ``write_policy``, else ``write_back``."""
    return config.write_policy if isinstance(config, HasWritePolicy) else "write_back"
