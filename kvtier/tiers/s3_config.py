"""The ``s3`` tier's config model, importable without boto3."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from kvtier.config import MAX_DURATION_S, LocalPath
from kvtier.tiers.configs import RemoteTierConfig

MAX_CHUNK_BLOCKS = 64
"""The most blocks per object an s3 tier's ``chunk_blocks`` may ask for on average."""


class S3TierConfig(RemoteTierConfig):
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
    put_deadline_s: float = Field(
        10.0,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Seconds a put's objects may spend on retries of throttled writes (503 SlowDown) "
            f"before the rest are dropped, counted. At most {MAX_DURATION_S:g}."
        ),
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
