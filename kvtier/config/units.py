"""Byte sizes: reading ``"8GiB"``, writing counts back the same way, and their config types.

A leaf: it imports nothing of kvtier, so the config models, the command line
and every layer parse and print sizes the one way defined here.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Annotated, Any

from pydantic import BeforeValidator, ByteSize, Field, WithJsonSchema

GiB = 1024**3

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


def human_bytes(count: int) -> str:
    """A size for people to read, rounded to one decimal (``"1.5GiB"``, ``"64.0MiB"``)."""
    return ByteSize(count).human_readable()
