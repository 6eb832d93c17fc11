"""A vLLM KV connector that does nothing: vLLM's connector plumbing with no store behind it.

It tells kvtier's own cost apart from what any connector costs in vLLM (the
metadata every step, the connector hooks around the forward, the
transfer-result checks): ``vllm_ttft.py``'s swapped engines take turns with it
(``zero_hit_kvtier_over_null_*``), and ``--throughput-method pairs
--throughput-baseline null`` runs the engine without kvtier with it instead of
none. vLLM loads it by module path (``kv_connector_module_path="null_connector"``);
the benchmark's directory is on the engine process's ``sys.path``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class NullMetadata(KVConnectorMetadata):
    """Nothing to tell the workers."""


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    """Matches no tokens, loads and saves nothing. It declares hybrid-model support, as
    kvtier's connector does, so that vLLM makes the same calls of both."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return NullMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
