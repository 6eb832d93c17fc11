"""The ``disk`` tier's config model, importable without the tier's I/O code."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field

from kvtier.config import MAX_DURATION_S, ByteCount, LocalPath
from kvtier.models import WritePolicy
from kvtier.tiers.configs import RecordKeyConfig, queue_depth_field, write_policy_field


def usable_cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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
