"""Bounds on config values: what the platform can represent and what an operator could mean.

A value past these is refused when the config is validated, one line each,
instead of failing (or overflowing) when the engine starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator

MAX_DURATION_S = 3600.0
"""The longest timeout, deadline or back-off any setting accepts: one hour. Every wait kvtier
makes is seconds at most; a longer one is a mistake of unit, and past ``threading.TIMEOUT_MAX``
(about 292 years) a wait overflows."""

MAX_QUEUE_DEPTH = 65536
"""The most requests a tier's queue may hold: far beyond what a tier drains within any deadline."""

MAX_TIERS = 16
"""The most entries of the ``tiers`` list: each tier runs its own threads and every demoted
block is written to all of them."""


def _checked_path(value: Any) -> Any:
    """Refuse an empty path (it would mean the working directory) and a NUL byte in one."""
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, str) and text == "":
            raise ValueError("empty path; name a directory, such as /var/cache/kvtier")
        if isinstance(text, str) and "\0" in text:
            raise ValueError("a path cannot hold a NUL byte")
    return value


LocalPath = Annotated[Path, BeforeValidator(_checked_path)]
"""A local filesystem path: not empty, without NUL bytes."""
