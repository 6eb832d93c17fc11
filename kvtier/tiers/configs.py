"""Config models of the built-in storage tiers, importable without their I/O libraries.

Validating a config needs these models; the tiers themselves (and ``redis``,
``mooncake``, ``xxhash``) are imported only when a config picks one.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator

from kvtier.config import (
    ENV_PREFIX,
    MAX_DURATION_S,
    MAX_QUEUE_DEPTH,
    ByteCount,
    LocalPath,
    PluginConfig,
)
from kvtier.config.units import ByteBudget
from kvtier.models import WritePolicy
from kvtier.tiers.mooncake_address import check_master_address, check_metadata_server
from kvtier.tiers.redis_url import check_redis_url


def usable_cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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


def backoff_field(default_s: float, description: str) -> Any:
    """A wait between tries after a failure, bounded like every duration of a tier."""
    return Field(
        default_s,
        gt=0,
        le=MAX_DURATION_S,
        description=f"{description} At most {MAX_DURATION_S:g}.",
    )


SHARED_TIER_WRITES = (
    "The default gives the other engines every block the host tier admitted as soon as it "
    "is stored, hot prefixes included (which the host tier may never evict)."
)
"""Why a tier shared by a fleet (redis, mooncake, s3) writes through by default."""


class RecordKeyConfig(PluginConfig):
    """The secret keys that seal a tier's records, named by where they are, never inline."""

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


class DiskTierConfig(RecordKeyConfig):
    """Block records in one preallocated file per rank on a local filesystem."""

    type: Literal["disk"] = "disk"
    path: LocalPath = Field(
        description=(
            "Directory of the tier's files (created if missing, private to this user); one "
            "file per rank, named after it, such as rank0-of2.kvtier. A directory other users "
            "can write must be sticky (like /tmp), and the files in it this user's."
        )
    )
    capacity_bytes: ByteCount = Field(
        description=(
            "Disk space in bytes for all ranks together, split evenly; each rank's file holds "
            "as many whole records as its share allows. Accepts sizes such as '100GiB'."
        )
    )
    eviction: str = Field(
        "lru",
        description=(
            "Registered block index (see `kvtier plugins`) that picks which record to evict "
            "when the file is full, with its default settings."
        ),
    )
    preallocate: bool = Field(
        True,
        description=(
            "Reserve the file's space at start-up, so a disk too small is a start-up error; "
            "without it the file grows as records are written, and writes that find the "
            "disk full are dropped and counted."
        ),
    )
    o_direct: bool = Field(
        False,
        description=(
            "Read and write the file with O_DIRECT, bypassing the page cache, through "
            "page-aligned buffers. A filesystem that refuses O_DIRECT (some network and FUSE "
            "filesystems) is a start-up error."
        ),
    )
    namespace: str = Field(
        "",
        description=(
            "Tenant namespace mixed into every key; records of another namespace are never "
            "returned. Empty uses the engine's namespace as it is."
        ),
    )
    io_threads: int = Field(
        default_factory=lambda: min(4, usable_cpus()),
        ge=1,
        le=256,
        description=(
            "Threads doing the tier's file I/O; by default 4, or one per CPU the process may "
            "run on where there are fewer. A put through the page cache hashes on one thread "
            "while another writes; more threads than cores spin on the file's lock instead. "
            "At most 256."
        ),
    )
    queue_depth: int = queue_depth_field()
    write_policy: WritePolicy = write_policy_field(
        "write_back",
        "The default keeps the disk's writes to what the host tier lets go, and a restart "
        "still finds what was in host memory.",
    )
    get_deadline_s: float | None = Field(
        1.0,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds a get may take before its keys are reported as misses; null waits "
            f"for the disk however long it takes. At most {MAX_DURATION_S:g}."
        ),
    )

    def store_name(self) -> str:
        """The directory, as the tiers list's check for one entry per store compares it."""
        return f"path {os.path.realpath(self.path)}"


class RedisTierConfig(RecordKeyConfig):
    """Block records in a Redis server or Redis Cluster shared by many engines."""

    type: Literal["redis"] = "redis"
    url: SecretStr = Field(
        description=(
            "Server URL: redis://[[user]:password@]host:port/db, or rediss://... for TLS. "
            "Kept secret: shown masked, and never logged with its password."
        )
    )
    cluster: bool = Field(
        False,
        description="The URL names a node of a Redis Cluster; keys are spread over its nodes.",
    )
    required: bool = Field(
        True,
        description=(
            "Fail start-up when the server does not answer; false logs a warning and runs "
            "with the tier disabled (every get a miss, every put dropped, counted)."
        ),
    )
    namespace: str = Field(
        "",
        description=(
            "Tenant namespace mixed into every key, so engines sharing the server never "
            "see each other's blocks. Empty uses the engine's namespace as it is."
        ),
    )
    timeout_s: float = Field(
        1.0,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds to connect, and to wait for each reply, before failing. "
            f"At most {MAX_DURATION_S:g}."
        ),
    )
    tls_ca_path: LocalPath | None = Field(
        None,
        description=(
            "CA bundle (PEM) that signed the server's certificate, for rediss:// URLs; "
            "null uses the system's trusted CAs."
        ),
    )
    io_threads: int = Field(
        2,
        ge=1,
        le=256,
        description=(
            "Threads doing the tier's requests, one connection each. Two keep a request in "
            "flight while the next is framed; more rarely help one Python process (a local "
            "server moved 2 MiB records faster over two connections than over four). At most 256."
        ),
    )
    queue_depth: int = queue_depth_field()
    write_policy: WritePolicy = write_policy_field("write_through", SHARED_TIER_WRITES)
    get_deadline_s: float | None = Field(
        1.0,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds a get may take before its keys are reported as misses; null waits "
            f"as long as the server's timeouts allow. At most {MAX_DURATION_S:g}."
        ),
    )
    reconnect_backoff_s: float = backoff_field(
        0.5, "Seconds the tier waits after a failed batch before it tries the server again."
    )
    reconnect_max_backoff_s: float = backoff_field(
        30.0, "The longest wait between tries; each failure in a row doubles the wait."
    )

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: SecretStr) -> SecretStr:
        check_redis_url(url.get_secret_value())
        return url


class MooncakeTierConfig(RecordKeyConfig):
    """Block records in a Mooncake Store shared by many engines."""

    type: Literal["mooncake"] = "mooncake"
    master_address: str = Field(
        description="The store's master, host:port (mooncake_master's rpc_port).",
    )
    metadata_server: str = Field(
        description=(
            "Where the store's transfer engines publish their addresses: "
            "http://host:port/metadata (the master's own, with "
            "--enable_http_metadata_server), etcd://host:port, redis://host:port, or "
            "P2PHANDSHAKE for none."
        ),
    )
    protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="Transport that moves the records: tcp, or rdma on RDMA NICs."
    )
    rdma_devices: str = Field(
        "",
        description=(
            "RDMA devices to use with protocol rdma, comma separated (such as mlx5_0,mlx5_1); "
            "empty lets the store pick."
        ),
    )
    local_hostname: str = Field(
        "127.0.0.1",
        min_length=1,
        max_length=255,
        description=(
            "This host's address as the store's other clients reach it; with "
            "global_segment_bytes above 0 it must be an address they can connect to."
        ),
    )
    global_segment_bytes: ByteBudget = Field(
        0,
        description=(
            "Memory in bytes this rank lends to the store's pool for everyone's records, "
            "released when the engine stops (its records go with it); 0 lends none, for a "
            "store whose memory is held by its own servers (mooncake_client). Accepts sizes "
            "such as '4GiB'."
        ),
    )
    local_buffer_bytes: ByteCount = Field(
        64 << 20,
        description=(
            "The client's own transfer buffer in bytes; it must hold a batch of records with "
            "their headers. Accepts sizes such as '64MiB'."
        ),
    )
    put_batch_bytes: ByteBudget = Field(
        16 << 20,
        description=(
            "Record bytes of waiting puts the tier sends in one client call: puts queued "
            "behind each other are joined up to this (a put is never split), as the store's "
            "cost per call is high. 0 sends each put on its own. Accepts sizes such as '16MiB'."
        ),
    )
    replicas: int = Field(
        1,
        ge=1,
        le=16,
        description="Copies of each record the store keeps, on different segments. At most 16.",
    )
    soft_pin_ttl_s: float | None = Field(
        None,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds each record is soft-pinned after it is written: the store evicts "
            "unpinned records first. Null pins nothing. At most "
            f"{MAX_DURATION_S:g}."
        ),
    )
    required: bool = Field(
        True,
        description=(
            "Fail start-up when the master does not answer; false logs a warning and runs "
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
            "Threads doing the tier's requests through the rank's one client. At most 256."
        ),
    )
    queue_depth: int = queue_depth_field()
    write_policy: WritePolicy = write_policy_field("write_through", SHARED_TIER_WRITES)
    get_deadline_s: float | None = Field(
        1.0,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds a get may take before its keys are reported as misses; null waits "
            f"as long as the client does. At most {MAX_DURATION_S:g}."
        ),
    )
    reconnect_backoff_s: float = backoff_field(
        0.5, "Seconds the tier waits after the master failed to answer before it tries again."
    )
    reconnect_max_backoff_s: float = backoff_field(
        30.0, "The longest wait between tries; each failure in a row doubles the wait."
    )

    @field_validator("master_address")
    @classmethod
    def _host_and_port(cls, address: str) -> str:
        check_master_address(address)
        return address

    @field_validator("metadata_server")
    @classmethod
    def _known_metadata_server(cls, server: str) -> str:
        check_metadata_server(server)
        return server


MAX_CHUNK_BLOCKS = 64
"""The most blocks per object an s3 tier's ``chunk_blocks`` may ask for on average."""


class S3TierConfig(RecordKeyConfig):
    """Block records in an S3-compatible object store (AWS S3, MinIO, Ceph RGW), for a fleet.

    Credentials come only from the standard AWS chain (environment, profile,
    container or instance role), never from this config.
    """

    type: Literal["s3"] = "s3"
    bucket: str = Field(
        description="Bucket of the tier's objects; it must exist (the tier never creates one).",
        pattern=r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$",
    )
    prefix: str = Field(
        "kvtier/",
        max_length=512,
        description=(
            "Start of every object name the tier writes, so the tier can share a bucket and a "
            "lifecycle rule can expire its objects."
        ),
    )
    endpoint_url: str | None = Field(
        None,
        description=(
            "http(s):// URL of an S3-compatible server (MinIO, Ceph RGW); null uses AWS S3's "
            "endpoint for the region."
        ),
    )
    region: str | None = Field(
        None,
        description=(
            "Region of the bucket, such as us-east-1; null takes it from the AWS chain "
            "(AWS_REGION, the profile)."
        ),
    )
    addressing_style: Literal["virtual", "path"] = Field(
        "virtual",
        description=(
            "virtual puts the bucket in the host name (AWS S3); path puts it in the URL path "
            "(MinIO, Ceph RGW, any server without wildcard DNS)."
        ),
    )
    profile: str | None = Field(
        None,
        description=(
            "Named profile of the AWS config files to take credentials and region from; null "
            "uses AWS_PROFILE or the default chain."
        ),
    )
    tls_ca_path: LocalPath | None = Field(
        None,
        description=(
            "CA bundle (PEM) that signed an https endpoint's certificate; null uses the "
            "system's trusted CAs."
        ),
    )
    chunk_blocks: int = Field(
        8,
        ge=1,
        le=MAX_CHUNK_BLOCKS,
        description=(
            "Mean consecutive blocks of one request per object: a prefix of N blocks costs "
            "about N / chunk_blocks requests. Keep it the same on every engine sharing the "
            f"prefix (it decides where objects end). At most {MAX_CHUNK_BLOCKS}."
        ),
    )
    required: bool = Field(
        True,
        description=(
            "Fail start-up when the bucket cannot be reached; false logs a warning and runs "
            "with the tier disabled (every get a miss, every put dropped, counted)."
        ),
    )
    namespace: str = Field(
        "",
        description=(
            "Tenant namespace mixed into every key, so engines sharing the bucket never "
            "see each other's blocks. Empty uses the engine's namespace as it is."
        ),
    )
    timeout_s: float = Field(
        2.0,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds to connect, and to wait for each response, before failing. "
            f"At most {MAX_DURATION_S:g}."
        ),
    )
    io_threads: int = Field(
        4,
        ge=1,
        le=256,
        description=(
            "Requests in flight at once, each on its own pooled connection: the objects of one "
            "batch are read or written in parallel, and this many batches may be in progress. "
            "At most 256."
        ),
    )
    queue_depth: int = queue_depth_field()
    write_policy: WritePolicy = write_policy_field("write_through", SHARED_TIER_WRITES)
    get_deadline_s: float | None = Field(
        1.0,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds a get may take before its keys are reported as misses; retries of "
            "throttled reads stop there too. null waits as long as the timeouts allow. "
            f"At most {MAX_DURATION_S:g}."
        ),
    )
    put_deadline_s: float = Field(
        10.0,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds a put's objects may spend on retries of throttled writes (503 SlowDown) "
            f"before the rest are dropped, counted. At most {MAX_DURATION_S:g}."
        ),
    )
    reconnect_backoff_s: float = backoff_field(
        0.5, "Seconds the tier waits after a failed batch before it tries the server again."
    )
    reconnect_max_backoff_s: float = backoff_field(
        30.0, "The longest wait between tries; each failure in a row doubles the wait."
    )

    def store_name(self) -> str:
        """The bucket and prefix at their endpoint, as the check for one entry per store
        compares them."""
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint_url or 'AWS S3'}"

    @field_validator("endpoint_url")
    @classmethod
    def _http_endpoint(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http:// or https:// URL with a host")
        if parts.username or parts.password:
            raise ValueError(
                "credentials do not belong in the URL; use the AWS chain (environment, profile, "
                "instance role)"
            )
        return url
