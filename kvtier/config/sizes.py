"""Byte sizes: parsing ``"8GiB"``, the memory this machine has, and the host tier's slot count.

:func:`host_slots` is the one place a host tier's slot count is computed; the
scheduler's manager, the workers' tiers and ``kvtier config validate`` all
reach it through :meth:`KVTierConfig.host_slots <kvtier.config.KVTierConfig.host_slots>`,
so every side agrees on it.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator, Field

from kvtier.config.errors import ConfigError, Problem

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig

GiB = 1024**3
MEMINFO = "/proc/meminfo"
"""Where Linux reports memory; ``MemAvailable`` is what new allocations can get."""

_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(value: Any) -> Any:
    """Turn a size such as ``"8GiB"``, ``"512 MB"`` or ``"4096"`` into a number of bytes.

    Integers pass through unchanged (range checks belong to the field); other
    types are returned as they are, for pydantic to reject with its own message.

    Args:
        value: An ``int`` or a string of digits with an optional unit
            (``B``, ``KB``, ``MB``, ``GB``, ``TB`` in powers of 1000;
            ``KiB``, ``MiB``, ``GiB``, ``TiB`` in powers of 1024).

    Returns:
        The number of bytes, or ``value`` unchanged when it is not a string.

    Raises:
        ValueError: ``value`` is a string that is not a size.
    """
    if isinstance(value, bool):
        raise ValueError("expected a number of bytes, not a boolean")
    if not isinstance(value, str):
        return value
    match = _SIZE_PATTERN.match(value)
    if match is None:
        raise ValueError("expected a number of bytes such as 8589934592, '8GiB' or '512MB'")
    number, unit = match.groups()
    return int(number) * _SIZE_UNITS[(unit or "b").lower()]


ByteCount = Annotated[
    int,
    BeforeValidator(parse_bytes, json_schema_input_type=int | str),
    Field(gt=0, le=2**63 - 1),
]
"""A positive number of bytes that fits a signed 64-bit size (what torch and CUDA take);
strings with a unit (``"8GiB"``, ``"512MB"``) are accepted."""


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


def host_bytes_per_rank(config: KVTierConfig, world_size: int) -> int:
    """``config.cpu_bytes_per_rank`` when set, else ``config.cpu_bytes // world_size``."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if config.cpu_bytes_per_rank is not None:
        return config.cpu_bytes_per_rank
    return config.cpu_bytes // world_size


def host_slots(config: KVTierConfig, record_bytes: int, world_size: int) -> int:
    """How many block records of ``record_bytes`` fit in one rank's host tier (at least 1).

    Raises:
        ConfigError: One rank's share is smaller than one block record; the
            line names ``cpu_bytes`` or ``cpu_bytes_per_rank`` and its source.
    """
    if record_bytes < 1:
        raise ValueError(f"record_bytes must be at least 1, got {record_bytes}")
    per_rank = host_bytes_per_rank(config, world_size)
    slots = per_rank // record_bytes
    if slots >= 1:
        return slots
    if config.cpu_bytes_per_rank is not None:
        field, value = "cpu_bytes_per_rank", config.cpu_bytes_per_rank
        message = (
            f"below one block record of {record_bytes} bytes; set it to at least {record_bytes}"
        )
    else:
        field, value = "cpu_bytes", config.cpu_bytes
        message = (
            f"{per_rank} bytes per rank over {world_size} rank(s) is below one block record "
            f"of {record_bytes} bytes; set it to at least {record_bytes * world_size}"
        )
    raise ConfigError([Problem(config.source_of(field), field, message, value)])


def check_host_memory(
    config: KVTierConfig, world_size: int, ranks: int, available_bytes: int | None
) -> None:
    """Raise a :class:`ConfigError` when ``ranks`` host tiers need more than is available.

    ``available_bytes`` of ``None`` reads :func:`available_memory_bytes`; when
    that is unknown too, nothing is checked.
    """
    per_rank = host_bytes_per_rank(config, world_size)
    if ranks < 1 or ranks > world_size:
        raise ValueError(f"ranks must be within 1..{world_size}, got {ranks}")
    available = available_memory_bytes() if available_bytes is None else available_bytes
    needed = per_rank * ranks
    if available is None or needed <= available:
        return
    field = "cpu_bytes" if config.cpu_bytes_per_rank is None else "cpu_bytes_per_rank"
    if ranks > 1:
        what = f"{ranks} ranks of {per_rank} bytes need {needed} bytes"
    elif world_size > 1:
        what = f"one rank of {world_size} needs {needed} bytes"
    else:
        what = f"the host tier needs {needed} bytes"
    message = (
        f"{what} ({_gib(needed)}), more than the {available} bytes ({_gib(available)}) of "
        f"memory available on this machine; lower {field}"
    )
    raise ConfigError([Problem(config.source_of(field), field, message, getattr(config, field))])


def _gib(count: int) -> str:
    return f"{count / GiB:.1f} GiB"
