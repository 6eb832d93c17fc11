"""kvtier: a tiered KV-cache store for LLM inference engines."""

from importlib.metadata import PackageNotFoundError, version

import pluggy

try:
    __version__ = version("kvtier")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

hookimpl = pluggy.HookimplMarker("kvtier")
"""Marker for plugin hook implementations: decorate a function with ``@kvtier.hookimpl``."""

__all__ = ["__version__", "hookimpl"]
