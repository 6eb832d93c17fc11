"""Configuration errors: one :class:`Problem` per mistake, formatted as one bounded line each."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the configuration."""

    source: str
    path: str
    message: str
    value: Any = None
    has_value: bool = True

    def __str__(self) -> str:
        got = _short_repr(self.value) if self.has_value else "nothing"
        return f"{self.source}: {self.path}: {self.message} (got {got})"


class ConfigError(ValueError):
    """The configuration is invalid; :attr:`lines` holds one formatted line per problem."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = tuple(problems)
        count = len(self.problems)
        header = f"invalid kvtier configuration: {count} problem{'s' if count != 1 else ''}"
        super().__init__("\n".join([header, *self.lines]))

    @property
    def lines(self) -> list[str]:
        """One ``<source>: <dotted.path>: <message> (got <value>)`` line per problem."""
        return [str(problem) for problem in self.problems]


class _ValueRepr(reprlib.Repr):
    """``repr`` in bounded time and size: a few items and levels of a container, cut strings."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxlong = self.maxother = limit

    def repr_int(self, x: int, level: int) -> str:
        # Decimal conversion of a huge integer is quadratic, and refused past 4300 digits.
        if x.bit_length() > 4 * self.maxlong:
            return f"<a {x.bit_length()}-bit integer>"
        return super().repr_int(x, level)


_VALUE_CHARS = 80
_VALUE_REPR = _ValueRepr(_VALUE_CHARS)


def _short_repr(value: Any, limit: int = _VALUE_CHARS) -> str:
    text = _VALUE_REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
