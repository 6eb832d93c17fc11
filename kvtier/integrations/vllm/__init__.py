"""vLLM integration: ``KVTierConnector``, loaded by vLLM from ``kv_connector_module_path``.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes": "16GiB"}}'

The installed vLLM's version is checked before any of its internals are
imported, so an unsupported release fails here with a message that says which
releases work.
"""

from kvtier.integrations.vllm.version import check_vllm_version

check_vllm_version()

from kvtier.integrations.vllm.connector import KVTierConnector  # noqa: E402

__all__ = ["KVTierConnector"]
