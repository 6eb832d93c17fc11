"""Checking the Mooncake tier's addresses the way its client reads them, without importing it.

The store's client takes the master as ``host:port`` and the metadata server
as a connection string; a malformed one fails deep inside the client at start-up
(or, for a metadata server, on the first transfer), so the config is checked here,
once, when it is validated.
"""

from __future__ import annotations

from urllib.parse import urlsplit

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
