"""The ``redis`` tier's config model, importable without the client.

Its URL is checked the way the client will read it: ``redis.Redis.from_url``
reads the port only when the tier connects (a port out of range or not a
number is a raw ``ValueError`` then), treats a port of 0 as "the default",
ignores a database path that is not a number, and passes query options it does
not know to the client's constructor (a ``TypeError``). The URL is checked
here instead, once, when the config is validated.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import Field, SecretStr, field_validator

from kvtier.config import MAX_DURATION_S, LocalPath
from kvtier.tiers.configs import RemoteTierConfig

SCHEMES = ("redis", "rediss")

URL_OPTIONS = (
    "client_name",
    "db",
    "health_check_interval",
    "password",
    "protocol",
    "retry_on_timeout",
    "socket_keepalive",
    "ssl_check_hostname",
    "username",
)
"""Query options a URL may carry; the others are the tier's own settings or not the client's."""

TIER_SETTINGS = {
    "max_connections": "io_threads",
    "socket_connect_timeout": "timeout_s",
    "socket_timeout": "timeout_s",
    "ssl_ca_certs": "tls_ca_path",
    "timeout": "timeout_s",
}
"""Query options that would override one of the tier's settings, and that setting."""

MAX_DB = 2**31 - 1
"""The largest database number a server accepts (``databases`` is a signed 32-bit count)."""


def check_redis_url(url: str) -> None:
    """Raise ``ValueError`` naming the first part of ``url`` the client would refuse or misread.

    The message never holds the URL's password.
    """
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unclosed "[" of an IPv6 address
        raise ValueError(f"not a URL ({exc}); write it as redis://host:6379/0") from None
    if parts.scheme not in SCHEMES:
        raise ValueError("expected a redis:// or rediss:// URL")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(
            f"the port is not a number from 1 to 65535 ({_port_text(parts.netloc)}); write the "
            "URL as redis://host:6379/0"
        ) from None
    if not parts.hostname:
        raise ValueError("the URL names no host; write it as redis://host:6379/0")
    if port == 0:
        raise ValueError("port 0 is not a server's port; write the URL as redis://host:6379/0")
    database = unquote(parts.path).lstrip("/")
    if database:
        _check_db(database, "the path")
    for name, values in parse_qs(parts.query, keep_blank_values=True).items():
        if name in TIER_SETTINGS:
            raise ValueError(
                f"the URL option {name!r} overrides the tier's own setting; set "
                f"{TIER_SETTINGS[name]} instead"
            )
        if name not in URL_OPTIONS:
            raise ValueError(
                f"unknown URL option {name!r}; the URL may carry {', '.join(URL_OPTIONS)}"
            )
        if name == "db":
            _check_db(values[0], "the option db")
        if name == "health_check_interval":
            _check_whole(values[0], name, 0, int(MAX_DURATION_S))
        if name == "protocol":
            _check_whole(values[0], name, 2, 3)


def _check_db(text: str, where: str) -> None:
    if not text.isdigit() or int(text) > MAX_DB:
        raise ValueError(
            f"{where} names database {text[:20]!r}, not a number from 0 to {MAX_DB}; write "
            "the URL as redis://host:6379/0"
        )


def _check_whole(text: str, name: str, low: int, high: int) -> None:
    if not text.isdigit() or not low <= int(text) <= high:
        raise ValueError(f"the URL option {name} must be a whole number from {low} to {high}")


def _port_text(netloc: str) -> str:
    """What stands where the port should, without anything before the host (a password)."""
    return repr(netloc.rpartition("@")[2].rpartition(":")[2][:20])


class RedisTierConfig(RemoteTierConfig):
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

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: SecretStr) -> SecretStr:
        check_redis_url(url.get_secret_value())
        return url
