"""Byte sizes: parsing ``"8GiB"``, the memory this machine has, and the host tier's slot count.

:func:`host_slots` is the one place a host tier's slot count is computed; the
scheduler's manager, the workers' tiers and ``kvtier config validate`` all
reach it through :meth:`KVTierConfig.host_slots <kvtier.config.KVTierConfig.host_slots>`,
so every side agrees on it.
"""

from __future__ import annotations

import math
import os
import re
from fractions import Fraction
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator, ByteSize, Field, WithJsonSchema

from kvtier.config.errors import ConfigError, Problem

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig

GiB = 1024**3
MEMINFO = "/proc/meminfo"
"""Where Linux reports memory; ``MemAvailable`` is what new allocations can get."""

SIZE_UNITS: dict[str, int] = {
    unit: int(factor) for unit, factor in ByteSize.byte_sizes.items() if "bit" not in unit
}
"""Units a size string may end with, lower case, in bytes: pydantic's :class:`~pydantic.ByteSize`
byte units (``b``; ``k``/``kb`` to ``e``/``eb`` in powers of 1000; ``kib`` to ``eib`` in
powers of 1024)."""

_NUMBER_AND_UNIT = r"([0-9]*\.?[0-9]+)\s*([KkMmGgTtPpEe](?:[Ii]?[Bb])?|[Bb])?\s*$"
SIZE_PATTERN = r"^\s*(?=[0-9.]*[1-9])" + _NUMBER_AND_UNIT
"""A positive size string: a number with a non-zero digit, then an optional unit of
:data:`SIZE_UNITS` in any case. Python's :mod:`re` and JSON Schema's ``pattern`` read it alike."""
_SIZE_RE = re.compile(r"^\s*" + _NUMBER_AND_UNIT)
MAX_BYTES = 2**63 - 1
"""The largest size: a signed 64-bit count, what torch and CUDA take."""
_MAX_DIGITS = 40  # a longer number is past MAX_BYTES in any unit; Python refuses 4300 digits


def parse_bytes(value: Any) -> Any:
    """Turn a size such as ``"8GiB"``, ``"1.5GiB"``, ``"64G"`` or ``"4096"`` into bytes.

    Sizes mean what they mean to pydantic's :class:`~pydantic.ByteSize` (and to
    vLLM, LMCache and SGLang): ``K``, ``KB``, ``M``, ``MB``, ``G``, ``GB``,
    ``T``, ``TB`` ... are powers of 1000, ``KiB``, ``MiB``, ``GiB``, ``TiB`` ...
    powers of 1024, in any case; a fraction of a byte is dropped. Unlike
    ``ByteSize``, nothing may follow the unit, and bit units are refused.

    Integers pass through unchanged (range checks belong to the field); other
    types are returned as they are, for pydantic to reject with its own message.

    Args:
        value: An ``int``, or a string: a number (``"1.5"``, ``".5"``), then an optional unit.

    Returns:
        The number of bytes, or ``value`` unchanged when it is not a string.

    Raises:
        ValueError: ``value`` is a boolean, or a string that is not a size.
    """
    if isinstance(value, bool):
        raise ValueError("expected a number of bytes, not a boolean")
    if not isinstance(value, str):
        return value
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(
            "expected a number of bytes such as 8589934592, '8GiB', '1.5GiB', '64G' or '512MB'"
        )
    number, unit = match.groups()
    if len(number) > _MAX_DIGITS:
        raise ValueError(f"more than the {MAX_BYTES} bytes a size may have")
    return math.floor(Fraction(number) * SIZE_UNITS[(unit or "b").lower()])


def format_bytes(count: int) -> str:
    """Write a number of bytes the shortest exact way :func:`parse_bytes` reads back.

    ``8589934592`` is ``"8GiB"``, ``1610612736`` is ``"1.5GiB"``, ``64000000000``
    is ``"64GB"``; on a tie a unit wins over none and a binary unit over a decimal
    one (``4096`` is ``"4KiB"``); a count no unit divides into at most three
    decimals stays a plain number (``"1000001"``).
    """
    candidates = [(len(str(count)), 2, str(count))]
    for rank, units in enumerate((_BINARY_UNITS, _DECIMAL_UNITS)):
        for unit in units:
            factor = SIZE_UNITS[unit.lower()]
            if count < factor or (count * 1000) % factor:
                continue
            whole, thousandths = divmod(count * 1000 // factor, 1000)
            text = f"{whole}.{thousandths:03d}".rstrip("0").rstrip(".") + unit
            candidates.append((len(text), rank, text))
    return min(candidates)[2]


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
_DECIMAL_UNITS = ("KB", "MB", "GB", "TB", "PB", "EB")


def _byte_schema(minimum: int) -> WithJsonSchema:
    return WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": minimum, "maximum": MAX_BYTES},
                {"type": "string", "pattern": SIZE_PATTERN},
            ]
        }
    )


ByteCount = Annotated[int, BeforeValidator(parse_bytes), Field(gt=0, le=MAX_BYTES), _byte_schema(1)]
"""A positive number of bytes that fits a signed 64-bit size (what torch and CUDA take);
strings with a unit (``"8GiB"``, ``"1.5GiB"``, ``"64G"``, ``"512MB"``) are accepted. Its
JSON Schema checks a string's form; the value a string stands for is checked on loading."""

ByteBudget = Annotated[
    int, BeforeValidator(parse_bytes), Field(ge=0, le=MAX_BYTES), _byte_schema(0)
]
"""A :data:`ByteCount` that may be 0, for a budget that 0 turns off."""


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
