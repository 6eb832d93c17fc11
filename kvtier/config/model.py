"""The configuration as plain data: :class:`KVTierConfig`, its top-level settings and sections.

Nothing here loads a plugin or imports an implementation: a pluggable section
(``index``, ``copy``, ``layout``, and each entry of the ``tiers`` list) holds
either a plugin's own config instance or, when given as plain data, a
:class:`SectionConfig` that keeps its ``type`` and settings as they were given.
They are checked against the plugin's own model where a registry is at hand:
:func:`~kvtier.config.load_config` and :meth:`Registry.build <kvtier.plugins.Registry.build>`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvtier.config.bounds import MAX_DURATION_S, MAX_TIERS
from kvtier.config.errors import ConfigError, Problem
from kvtier.config.units import ByteBudget, ByteCount, GiB
from kvtier.kinds import KINDS, Kind
from kvtier.models import KVTierModel, PluginConfig

DEFAULT_CPU_BYTES = 8 * GiB
DEFAULT_COPY_DEADLINE_S = 10.0
DEFAULT_REPORT_DEADLINE_S = 30.0
DEFAULT_CLOSE_TIMEOUT_S = 10.0
DEFAULT_FLUSH_DEADLINE_S = 4.0
MEMINFO = "/proc/meminfo"
"""Where Linux reports memory; ``MemAvailable`` is what new allocations can get."""
DEFAULT_SAME_STEP_LOAD_BYTES = 16 << 20
DEFAULT_PIN_SHARE = 0.25
DEFAULT_PIN_MAX_S = 600.0
DEFAULT_PREFETCH_TIMEOUT_S = 1.0
DEFAULT_PREFETCH_HOST_SHARE = 0.5
DEFAULT_SOURCE = "default"
"""What :meth:`KVTierConfig.source_of` answers for a value no source set."""


@dataclass(frozen=True)
class Section:
    """A pluggable section of :class:`KVTierConfig` and the plugin kind that fills it."""

    field: str
    kind: Kind[Any]
    default: str
    description: str


SECTIONS: tuple[Section, ...] = tuple(
    Section(kind.section, kind, kind.default, kind.description)
    for kind in KINDS
    if kind.section is not None and kind.default is not None
)
"""The pluggable sections, with the implementation each uses when the config names none."""

SECTIONS_BY_FIELD = {section.field: section for section in SECTIONS}

TIERS_FIELD = "tiers"
"""The :class:`KVTierConfig` field listing the storage tiers below the host tier, in order."""
TIERS_DESCRIPTION = (
    "Storage tiers below the host tier, in lookup order: each entry is one storage-tier "
    "plugin's settings, picked by its `type` (see `kvtier plugins`). Each tier's "
    "`write_policy` says when host-tier blocks are written to it (shared stores as soon as "
    "they are stored, a disk on eviction and shutdown); a lookup searches them in order. "
    f"Empty keeps blocks in host memory only. At most {MAX_TIERS} entries; two entries that "
    "write the same store (identical entries, or disk tiers on one path) are refused."
)


def section_shorthand(value: Any) -> Any:
    """Accept ``copy: torch`` for ``copy: {type: torch}``."""
    return {"type": value} if isinstance(value, str) else value


# The section is called ``copy`` in every config source; the ``BaseModel.copy`` method it hides
# is deprecated in pydantic 2 (``model_copy`` replaces it). Models with the field are built
# inside ``warnings.catch_warnings()`` with this filter, so no filter outlives them.
COPY_SHADOWS = r'Field name "copy" in "KVTierConfig" shadows an attribute'


class SectionConfig(PluginConfig):
    """A pluggable section given as plain data: its ``type`` and its settings, unvalidated.

    A plain :class:`KVTierConfig` keeps a section in this form; the plugin's
    own config model checks the settings once a registry is given.
    """

    model_config = ConfigDict(extra="allow")


PrefetchPolicy = Literal["off", "best_effort", "wait_complete", "timeout"]
"""What a request's first lookup answers while the blocks read for it at arrival are still
being read (see :mod:`kvtier.offload.prefetch`)."""


class PrefetchConfig(KVTierModel):
    """Reads from the tiers below the host tier started when a request arrives, while it waits."""

    policy: PrefetchPolicy = Field(
        "wait_complete",
        description=(
            "'off': a request's blocks held below the host tier are read at its first lookup, "
            "which asks the engine to try again until they are. Otherwise they start being "
            "read when the request arrives, and its first lookup, while they are still being "
            "read, waits for them ('wait_complete'), waits at most until timeout_s after "
            "arrival ('timeout'), or answers with the host tier's hits at once "
            "('best_effort'); a read it stopped waiting for is a miss."
        ),
    )
    timeout_s: float = Field(
        DEFAULT_PREFETCH_TIMEOUT_S,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "With policy 'timeout': seconds after a request's arrival past which its lookup "
            f"stops waiting for its prefetch. At most {MAX_DURATION_S:g}."
        ),
    )
    max_host_share: float = Field(
        DEFAULT_PREFETCH_HOST_SHARE,
        gt=0,
        le=1,
        description=(
            "Share of the host tier's slots that prefetches of waiting requests may reserve "
            "or keep pinned at once, with the host hits kept for lookups that wait for the "
            "rest; a prefetch past it reads fewer blocks, and the request's first lookup "
            "reads the rest."
        ),
    )

    @field_validator("policy", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    @model_validator(mode="after")
    def _timeout_needs_its_policy(self) -> PrefetchConfig:
        if "timeout_s" in self.model_fields_set and self.policy != "timeout":
            raise ValueError(
                f"timeout_s applies only to policy 'timeout' (policy is {self.policy!r}); "
                "set policy: timeout or leave timeout_s out"
            )
        return self


class RootSettings(KVTierModel):
    """The top-level settings of a config: :class:`KVTierConfig` without its pluggable sections.

    The base of :class:`KVTierConfig` and of the validating model
    :func:`~kvtier.config.config_model` builds for a registry.
    """

    cpu_bytes: ByteCount = Field(
        DEFAULT_CPU_BYTES,
        description=(
            "Host (CPU DRAM) tier size in bytes for the whole server, split evenly over the "
            "engine's ranks (tensor- and pipeline-parallel workers). Accepts sizes such as "
            "'8GiB'."
        ),
    )
    cpu_bytes_per_rank: ByteCount | None = Field(
        None,
        description=(
            "Host tier size in bytes for each rank; when set it overrides the even split of "
            "cpu_bytes. Accepts sizes such as '2GiB'."
        ),
    )
    store_mode: Literal["eager", "lazy"] = Field(
        "eager",
        description=(
            "When blocks are copied to the host tier: 'eager' stores every newly computed full "
            "block; 'lazy' stores blocks only as the engine is about to evict them."
        ),
    )
    same_step_load_bytes: ByteBudget = Field(
        DEFAULT_SAME_STEP_LOAD_BYTES,
        description=(
            "Host-tier hits of up to this many bytes per rank in all, each engine step, are "
            "copied to the device at the start of the step that schedules their requests, "
            "before its forward, so those requests compute in that step (a hit in a tier "
            "below is one once it was read into the host tier); larger hits, and all hits "
            "of models with several kv-cache groups, are loaded a step ahead while their "
            "requests wait. 0 loads every hit a step ahead. Accepts sizes such as '16MiB'."
        ),
    )
    cost_guard: bool = Field(
        True,
        description=(
            "Skip a load, from the host tier or a tier below, that is predicted slower than "
            "recomputing its tokens, from the read times and prefill speed measured as the "
            "engine runs; the engine then computes those tokens. Until a cost is measured "
            "nothing is skipped."
        ),
    )
    cost_guard_margin: float = Field(
        1.0,
        gt=0,
        le=1000,
        description=(
            "The cost guard skips a load predicted to take more than this many times as long "
            "as recomputing its tokens: above 1 it loads more, below 1 it recomputes more."
        ),
    )
    copy_deadline_s: float = Field(
        DEFAULT_COPY_DEADLINE_S,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds a copy between the engine and the host tier may run before its worker "
            "stops waiting: a load becomes a recompute, a store is dropped, and the copy's host "
            f"slots stay out of use until it ends. At most {MAX_DURATION_S:g} (one hour)."
        ),
    )
    report_deadline_s: float = Field(
        DEFAULT_REPORT_DEADLINE_S,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds the scheduler waits for every rank to report a planned copy before it "
            "fails the copy (a load becomes a recompute, a store is dropped); its host slots "
            "stay out of use until every rank reported. Keep it above copy_deadline_s. "
            f"At most {MAX_DURATION_S:g}."
        ),
    )
    namespace: str = Field(
        "",
        description=(
            "Tenant namespace mixed into the key of every record below the host tier, with the "
            "model, the layout fingerprint and the rank: engines sharing a store see only "
            "records of their own namespace. A tier's own namespace setting overrides it."
        ),
    )
    pin_share: float = Field(
        DEFAULT_PIN_SHARE,
        ge=0,
        le=1,
        description=(
            "Share of the host tier's slots that requests may pin with the pin_s of their "
            "kv_transfer_params (see the per-request control page); a pin past it is not "
            "made, so pins never take more of the tier. 0 turns pins off."
        ),
    )
    pin_max_s: float = Field(
        DEFAULT_PIN_MAX_S,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "The longest pin a request gets: a longer pin_s in its kv_transfer_params is cut "
            f"to this many seconds. At most {MAX_DURATION_S:g}."
        ),
    )
    prefetch: PrefetchConfig = Field(
        default_factory=PrefetchConfig,
        description=(
            "Reading a request's blocks from the tiers below the host tier as it arrives, "
            "while it waits in the engine's queue (see the `prefetch` section below)."
        ),
    )
    close_timeout_s: float = Field(
        DEFAULT_CLOSE_TIMEOUT_S,
        ge=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds shutdown waits for copies still running; after it they are abandoned and "
            "the host tier's memory is deliberately not freed, so a late copy cannot write "
            f"freed memory. At most {MAX_DURATION_S:g}."
        ),
    )
    flush_deadline_s: float = Field(
        DEFAULT_FLUSH_DEADLINE_S,
        ge=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds a graceful shutdown may spend writing the blocks still in the host tier "
            "to the write_back tiers (and write_through ones) that lack them, after the copies "
            "in flight ended; blocks not handed to a tier by then are skipped, and both are "
            "counted in the shutdown's log line. 0 writes nothing. vLLM kills worker processes "
            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5) after it asked them to stop: raise that "
            f"with this. At most {MAX_DURATION_S:g}."
        ),
    )


def _section_field(field: str) -> Any:
    section = SECTIONS_BY_FIELD[field]
    return Field(
        default_factory=partial(SectionConfig, type=section.default),
        description=section.description,
    )


with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=COPY_SHADOWS, category=UserWarning)

    class KVTierConfig(RootSettings):
        """The kvtier configuration, as plain data.

        :func:`~kvtier.config.load_config` builds it from its sources,
        validates every section against the installed plugins (each then holds
        the plugin's own config instance) and records where each value came
        from. Constructing it directly loads no plugin: a section given as a
        string or mapping (``KVTierConfig(copy={"type": "torch"})``) is kept
        as a :class:`SectionConfig`, a mapping without ``type`` naming the
        section's default implementation; omitted sections name theirs.

        Two configs are equal when they hold the same settings, wherever
        each came from (:meth:`source_of` is not compared): the same
        top-level values, and per section the same ``type`` and the same
        settings as given. A setting left out is not filled in from the
        plugin's defaults for the comparison (a plain config does not know
        them), so ``copy: {type: torch}`` and ``copy: {type: torch, streams: 1}``
        differ even where 1 is the default; ``KVTierConfig()`` equals
        ``load_config({}, env={})``.
        """

        index: SerializeAsAny[PluginConfig] = _section_field("index")
        copy: SerializeAsAny[PluginConfig] = _section_field("copy")  # type: ignore[assignment]
        layout: SerializeAsAny[PluginConfig] = _section_field("layout")
        tiers: tuple[SerializeAsAny[PluginConfig], ...] = Field(
            (), max_length=MAX_TIERS, description=TIERS_DESCRIPTION
        )

        _sources: dict[str, str] = PrivateAttr(default_factory=dict)

        @field_validator("index", "copy", "layout", mode="before")
        @classmethod
        def _plain_section(cls, value: Any, info: ValidationInfo) -> Any:
            value = section_shorthand(value)
            if isinstance(value, Mapping):
                assert info.field_name is not None
                default = SECTIONS_BY_FIELD[info.field_name].default
                return SectionConfig.model_validate({"type": default, **value})
            return value

        @field_validator("tiers", mode="before")
        @classmethod
        def _plain_tiers(cls, value: Any) -> Any:
            if isinstance(value, (list, tuple)):
                return tuple(
                    SectionConfig.model_validate(entry) if isinstance(entry, Mapping) else entry
                    for entry in value
                )
            return value

        def __eq__(self, other: object) -> bool:
            if not isinstance(other, KVTierConfig):
                return NotImplemented
            return self._compared() == other._compared()

        def __hash__(self) -> int:
            return hash(json.dumps(self._compared(), sort_keys=True, default=repr))

        def _compared(self) -> dict[str, Any]:
            """What equality compares: top-level values, and each section's type and settings."""
            values: dict[str, Any] = {
                name: getattr(self, name) for name in RootSettings.model_fields
            }
            for section in SECTIONS:
                given: PluginConfig = getattr(self, section.field)
                values[section.field] = {
                    **given.model_dump(mode="json", exclude_unset=True),
                    "type": given.type,
                }
            values[TIERS_FIELD] = [
                # python mode: a secret (a Redis password) compares by its value, not its mask
                {**tier.model_dump(exclude_unset=True), "type": tier.type}
                for tier in self.tiers
            ]
            return values

        def source_of(self, path: str) -> str:
            """Return where the value at dotted ``path`` came from.

            Args:
                path: A dotted field path such as ``"cpu_bytes"`` or ``"copy.type"``.

            Returns:
                ``"explicit"``, ``"env KVTIER_..."``, ``"file <path>"`` or ``"default"``.
            """
            return self._sources.get(path, DEFAULT_SOURCE)

        def sources(self) -> dict[str, str]:
            """Return every leaf value's dotted path mapped to where it came from."""
            return {path: self.source_of(path) for path in _leaf_paths(self.model_dump())}

        def host_bytes_per_rank(self, world_size: int) -> int:
            """Return the host tier bytes of one rank.

            Args:
                world_size: Number of ranks (workers) the engine runs.

            Returns:
                ``cpu_bytes_per_rank`` when set, else ``cpu_bytes // world_size``.
            """
            if world_size < 1:
                raise ValueError(f"world_size must be at least 1, got {world_size}")
            if self.cpu_bytes_per_rank is not None:
                return self.cpu_bytes_per_rank
            return self.cpu_bytes // world_size

        def host_slots(self, record_bytes: int, world_size: int = 1) -> int:
            """Return how many block records fit in one rank's host tier.

            The one slot count of the host tier: the scheduler's manager, the
            workers' tiers and ``kvtier config validate`` all call it.

            Args:
                record_bytes: Bytes of one block across all layers (``KVLayout.record_bytes``).
                world_size: Number of ranks the host tier is split over.

            Returns:
                The slot count, at least 1.

            Raises:
                ConfigError: One rank's share is smaller than one block record; the
                    line names ``cpu_bytes`` or ``cpu_bytes_per_rank`` and its source.
            """
            if record_bytes < 1:
                raise ValueError(f"record_bytes must be at least 1, got {record_bytes}")
            per_rank = self.host_bytes_per_rank(world_size)
            slots = per_rank // record_bytes
            if slots >= 1:
                return slots
            if self.cpu_bytes_per_rank is not None:
                field, value = "cpu_bytes_per_rank", self.cpu_bytes_per_rank
                message = (
                    f"below one block record of {record_bytes} bytes; "
                    f"set it to at least {record_bytes}"
                )
            else:
                field, value = "cpu_bytes", self.cpu_bytes
                message = (
                    f"{per_rank} bytes per rank over {world_size} rank(s) is below one block "
                    f"record of {record_bytes} bytes; "
                    f"set it to at least {record_bytes * world_size}"
                )
            raise ConfigError([Problem(self.source_of(field), field, message, value)])

        def check_host_memory(
            self, world_size: int = 1, *, ranks: int = 1, available_bytes: int | None = None
        ) -> None:
            """Check, before anything is allocated, that host tiers fit in the memory available.

            Args:
                world_size: Number of ranks the host tier is split over.
                ranks: Ranks whose host tiers this machine is about to hold: 1 in a
                    worker about to allocate its own, ``world_size`` to check a whole
                    server ahead of time.
                available_bytes: Memory to check against;
                    :func:`available_memory_bytes` if ``None``
                    (no check when that cannot be read either).

            Raises:
                ConfigError: The tiers need more; the line names ``cpu_bytes`` or
                    ``cpu_bytes_per_rank``, its source, and both numbers.
            """
            per_rank = self.host_bytes_per_rank(world_size)
            if ranks < 1 or ranks > world_size:
                raise ValueError(f"ranks must be within 1..{world_size}, got {ranks}")
            available = available_memory_bytes() if available_bytes is None else available_bytes
            needed = per_rank * ranks
            if available is None or needed <= available:
                return
            field = "cpu_bytes" if self.cpu_bytes_per_rank is None else "cpu_bytes_per_rank"
            if ranks > 1:
                what = f"{ranks} ranks of {per_rank} bytes need {needed} bytes"
            elif world_size > 1:
                what = f"one rank of {world_size} needs {needed} bytes"
            else:
                what = f"the host tier needs {needed} bytes"
            message = (
                f"{what} ({_gib(needed)}), more than the {available} bytes ({_gib(available)}) "
                f"of memory available on this machine; lower {field}"
            )
            problem = Problem(self.source_of(field), field, message, getattr(self, field))
            raise ConfigError([problem])


def available_memory_bytes(meminfo: str | os.PathLike[str] = MEMINFO) -> int | None:
    """Return the memory this machine can give new allocations without swapping, in bytes.

    Args:
        meminfo: The kernel's memory report to read ``MemAvailable`` from.

    Returns:
        ``MemAvailable`` from ``meminfo``; where that cannot be read, the
        machine's physical memory (``os.sysconf``); ``None`` when neither is known.
    """
    try:
        with open(meminfo, encoding="ascii") as report:
            for line in report:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _gib(count: int) -> str:
    return f"{count / GiB:.1f} GiB"


def _leaf_paths(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            paths.extend(_leaf_paths(value, f"{path}."))
        else:
            paths.append(path)
    return paths
