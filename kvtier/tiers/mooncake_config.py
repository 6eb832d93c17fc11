"""The ``mooncake`` tier's config model, importable without the store's client.

Its addresses are checked the way the client reads them: the client takes the
master as ``host:port`` and the metadata server as a connection string; a
malformed one fails deep inside the client at start-up (or, for a metadata
server, on the first transfer), so they are checked here, once, when the
config is validated.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from kvtier.config import MAX_DURATION_S, ByteCount
from kvtier.config.units import ByteBudget
from kvtier.tiers.configs import RemoteTierConfig

METADATA_SCHEMES = ("http", "https", "etcd", "redis")
P2P_HANDSHAKE = "P2PHANDSHAKE"
"""The metadata server's value for none: clients exchange addresses directly."""


def check_master_address(address: str) -> None:
    """Raise ``ValueError`` unless ``address`` is ``host:port`` with a port from 1 to 65535."""
    host, colon, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or any(c in host for c in "/@ ?#"):
        raise ValueError("expected the master as host:port, such as mooncake-master:50051")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"the port is not a number from 1 to 65535 ({port[:20]!r}); write the master as "
            "host:port, such as mooncake-master:50051"
        )


def check_metadata_server(server: str) -> None:
    """Raise ``ValueError`` unless ``server`` is a metadata URL the client knows, or none."""
    if server == P2P_HANDSHAKE:
        return
    try:
        parts = urlsplit(server)
        port = parts.port
    except ValueError:
        port, parts = None, None
    if parts is None or parts.scheme not in METADATA_SCHEMES or not parts.hostname or port == 0:
        raise ValueError(
            "expected http://host:port/metadata (the master's own metadata server), "
            f"etcd://host:port, redis://host:port or {P2P_HANDSHAKE}"
        )


class MooncakeTierConfig(RemoteTierConfig):
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
        4 << 20,
        description=(
            "Record bytes of waiting puts the tier sends in one client call: puts queued "
            "behind each other are joined up to this (a put is never split), as the store's "
            "cost per call is high. A call holds an I/O thread, and the store, while it runs, "
            "so gets wait behind it: larger calls raise put throughput little and make gets "
            "late. 0 sends each put on its own. Accepts sizes such as '4MiB'."
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
