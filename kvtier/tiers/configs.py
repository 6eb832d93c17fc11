"""Config models the built-in storage tiers share, importable without their I/O libraries.

Each tier's own config model sits beside its code, in a module of its own
(``disk_config``, ``redis_config``, ``mooncake_config``, ``s3_config``), so
that validating a config needs only these modules: the tiers themselves (and
``redis``, ``boto3``, ``mooncake``, ``xxhash``) are imported only when a
config picks one. :class:`RecordKeyConfig` holds the keys that seal records
below the host tier; :class:`RemoteTierConfig` adds what every tier over a
store shared by a fleet (Redis, Mooncake, S3) sets.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator

from kvtier.config import (
    ENV_PREFIX,
    MAX_DURATION_S,
    MAX_QUEUE_DEPTH,
    LocalPath,
    PluginConfig,
    SectionConfig,
)
from kvtier.models import WritePolicy


def queue_depth_field() -> Any:
    """The ``queue_depth`` setting of every tier that runs on a QueuedTier."""
    return Field(
        64,
        ge=1,
        le=MAX_QUEUE_DEPTH,
        description=(
            "Requests of each kind (reads, writes) that may wait for an I/O thread; beyond "
            f"it a put is dropped and a get is a miss, both counted. At most {MAX_QUEUE_DEPTH}."
        ),
    )


def write_policy_field(default: WritePolicy, why: str) -> Any:
    """The ``write_policy`` setting of a storage tier: when host-tier blocks reach it."""
    return Field(
        default,
        description=(
            "When blocks of the host tier are written to this tier: write_through as soon as "
            "each is stored in the host tier; write_through_admitted only blocks the host tier "
            "served again (a hit), at their first reuse; write_back when the host tier evicts "
            "them, and on a graceful shutdown those still in host memory that the tier lacks "
            f"(within flush_deadline_s). {why}"
        ),
    )


CODEC_DESCRIPTION = (
    "Record codec (see `kvtier plugins`) that encodes each block before it is sealed and "
    "written, on the tier's I/O threads: `{type: lossless}` keeps every bit; `fp8` and "
    "`int8` halve a 16-bit record but change the values, and so the engine's outputs. "
    "Records written with another codec are misses, counted as `codec`. Null stores blocks "
    "as they are."
)


def plain_codec(value: Any) -> Any:
    """A ``codec`` setting as given: ``fp8`` for ``{type: fp8}``; a mapping kept unvalidated
    until a registry checks it against the codec's own model."""
    if isinstance(value, str):
        value = {"type": value}
    if isinstance(value, Mapping):
        return SectionConfig.model_validate(value)
    return value


class RecordKeyConfig(PluginConfig):
    """The secret keys that seal a tier's records, named by where they are, never inline,
    and the codec that encodes them first."""

    key_file: LocalPath | None = Field(
        None,
        description=(
            "File of the tier's secret keys, hex, one a line (make one with `openssl rand "
            "-hex 32`); the first seals records, every one verifies them. With a key, every "
            "record carries a MAC over header, key and payload: a record forged, altered or "
            "copied under another key by anyone without the key is a miss, counted as `auth`."
        ),
    )
    key_env: str | None = Field(
        None,
        description=(
            "Name of an environment variable holding more keys, hex, separated by commas or "
            "spaces; they come after key_file's. The config holds the name, never the key."
        ),
        repr=False,
    )
    encrypt: bool = Field(
        False,
        description=(
            "Seal records with AES-256-GCM instead of a MAC, so that whoever can read the "
            "store cannot read the KV either; needs a key."
        ),
    )
    require_key: bool = Field(
        False,
        description=(
            "Refuse to start without a key (key_file or key_env), instead of running with "
            "checksums only (a shared tier then logs a warning)."
        ),
    )

    codec: SerializeAsAny[PluginConfig] | None = Field(None, description=CODEC_DESCRIPTION)

    @field_validator("codec", mode="before")
    @classmethod
    def _plain_codec(cls, value: Any) -> Any:
        return plain_codec(value)

    @property
    def has_key(self) -> bool:
        """Whether a key source is set."""
        return self.key_file is not None or self.key_env is not None

    @field_validator("key_env")
    @classmethod
    def _variable_name(cls, name: str | None) -> str | None:
        if name is None:
            return name
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(
                "expected the name of an environment variable (letters, digits and _, not "
                "starting with a digit), not a key"
            )
        if name.startswith(ENV_PREFIX):
            raise ValueError(
                f"{ENV_PREFIX}* variables are read as config settings; name the key's "
                "variable without that prefix"
            )
        return name

    @field_validator("encrypt", "require_key")
    @classmethod
    def _key_given(cls, value: bool, info: ValidationInfo) -> bool:
        # key_file and key_env are validated before these flags; one that failed is absent
        # from info.data, and already reported.
        sources = [info.data.get(name, "invalid") for name in ("key_file", "key_env")]
        if value and sources == [None, None]:
            raise ValueError(
                f"{info.field_name} is true but this {info.data['type']} tier has no key; "
                "set key_file or key_env"
            )
        return value


class RemoteTierConfig(RecordKeyConfig):
    """The settings of every tier over a store that a fleet of engines shares."""

    required: bool = Field(
        True,
        description=(
            "Fail start-up when the store does not answer; false logs a warning and runs "
            "with the tier disabled (every get a miss, every put dropped, counted)."
        ),
    )
    namespace: str = Field(
        "",
        description=(
            "Tenant namespace mixed into every key, so engines sharing the store never "
            "see each other's blocks. Empty uses the engine's namespace as it is."
        ),
    )
    io_threads: int = Field(
        2,
        ge=1,
        le=256,
        description=(
            "Threads doing the tier's requests, each on a connection of its own where the "
            "store's client pools them. Two keep a request in flight while the next is "
            "prepared; more rarely help one Python process. At most 256."
        ),
    )
    queue_depth: int = queue_depth_field()
    write_policy: WritePolicy = write_policy_field(
        "write_through",
        "The default gives the other engines every block the host tier admitted as soon as it "
        "is stored, hot prefixes included (which the host tier may never evict).",
    )
    get_deadline_s: float | None = Field(
        1.0,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds a get may take before its keys are reported as misses; null waits "
            f"as long as the store's client does. At most {MAX_DURATION_S:g}."
        ),
    )
    fault_memory_s: float = Field(
        60.0,
        ge=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds a key whose record failed its checks is answered as a miss without "
            "reading it again (a put of the key ends it sooner); 0 reads it every time. "
            f"At most 65536 keys are remembered. At most {MAX_DURATION_S:g}."
        ),
    )
    reconnect_backoff_s: float = Field(
        0.5,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds the tier waits after the store failed to answer before it tries again. "
            f"At most {MAX_DURATION_S:g}."
        ),
    )
    reconnect_max_backoff_s: float = Field(
        30.0,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "The longest wait between tries; each failure in a row doubles the wait. "
            f"At most {MAX_DURATION_S:g}."
        ),
    )
