"""vLLM's own CPU offloading, with a worker whose copies finish at once and move no bytes.

``step_cost.py`` runs vLLM's ``OffloadingConnector`` beside kvtier. Its
scheduler side (``CPUOffloadingSpec.get_manager()``: the CPU chunk pool and its
LRU or ARC policy) needs no device, but ``CPUOffloadingSpec.get_worker()``
refuses any platform but CUDA-alike and XPU ones. :class:`InstantCPUOffloadingSpec`
is that spec with only ``get_worker`` replaced: vLLM's connector worker
(``OffloadingConnectorWorker``: deferred stores, flushes, finished loads,
completed-job reports) runs as it is, over :class:`InstantOffloadingWorker`, which
completes every store and load the moment it is submitted, as kvtier's copy
backend ``none`` does for kvtier. vLLM loads the spec by module path
(``spec_name`` and ``spec_module_path`` in ``kv_connector_extra_config``, see
:func:`offloading_config`); the benchmark's directory is on ``sys.path``.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

OFFLOADING_CONNECTOR = (
    "OffloadingConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
)
"""vLLM's offloading connector: ``kv_connector`` and ``kv_connector_module_path``."""


class InstantOffloadingWorker(OffloadingWorker):
    """Every submitted transfer is finished by the next ``get_finished``; nothing is copied."""

    def __init__(self) -> None:
        self._finished: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._finished.append(TransferResult(job_id=job_id, success=True))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        self._finished.append(TransferResult(job_id=job_id, success=True))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Nothing is in flight: a submitted transfer is already finished."""


class InstantCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (its manager unchanged) with :class:`InstantOffloadingWorker`."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        return InstantOffloadingWorker()


def offloading_config(
    host_blocks: int, block_bytes: int, eviction_policy: str = "lru"
) -> dict[str, Any]:
    """``kv_connector_extra_config`` for a CPU pool of ``host_blocks`` one-block chunks.

    vLLM pads each chunk of ``block_bytes`` (every layer's page of a block) to whole
    memory pages (``CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT``), so the bytes asked for are
    ``host_blocks`` padded chunks; ``eviction_policy`` is ``lru`` or ``arc``.
    """
    page = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    return {
        "spec_name": InstantCPUOffloadingSpec.__name__,
        "spec_module_path": __name__,
        "cpu_bytes_to_use": host_blocks * -(-block_bytes // page) * page,
        "eviction_policy": eviction_policy,
    }
