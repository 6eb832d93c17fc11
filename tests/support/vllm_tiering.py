"""vLLM's own tiering manager on CPU, with kvtier storage tiers below its CPU tier, for tests.

:class:`TieringEngine` builds vLLM's ``TieringOffloadingSpec`` the way the
``OffloadingConnector`` does, for a small made-up model whose blocks are one
chunk each, and gets vLLM's ``TieringOffloadingManager`` from it: its CPU
primary tier is vLLM's own host buffer, and each kvtier tier is loaded by
vLLM's secondary-tier factory from ``module_path``, as in a served engine.
It then plays the parts of vLLM's scheduler and worker around the manager:

- :meth:`TieringEngine.store` offers chunks for a request, writes each one's
  bytes into the CPU tier (as the worker's GPU-to-CPU copy would) and
  completes the store, which cascades it to every secondary tier;
- :meth:`TieringEngine.lookup` looks a prefix up the way vLLM's scheduler
  does, step after step, until no chunk before the first miss is pending;
- :meth:`TieringEngine.load` reads the CPU tier's chunks of a prefix hit;
- :meth:`TieringEngine.settle` steps until no transfer is in flight.

Every chunk's bytes derive from its key (:func:`chunk_bytes`), so a wrong
byte anywhere in a round trip is caught.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.integrations.vllm.adapters import adapter_for

TIER_CLASS = "KVTierSecondaryTier"
TIER_MODULE = "kvtier.integrations.vllm.tiering"
CHUNK_BYTES = 4096
"""Bytes of one chunk (one block of the made-up model, on its one worker)."""
TOKENS_PER_CHUNK = 16
"""Tokens of one chunk of the made-up model."""

_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def secondary_tier(tier: Mapping[str, Any], **settings: Any) -> dict[str, Any]:
    """One entry of vLLM's ``secondary_tiers`` that runs the kvtier storage tier ``tier``."""
    return {"type": TIER_CLASS, "module_path": TIER_MODULE, "tier": dict(tier), **settings}


def chunk_keys(count: int, seed: str) -> list[OffloadKey]:
    """Keys of a prompt's first ``count`` chunks: chained hashes, different for each seed."""
    keys: list[OffloadKey] = []
    previous = seed.encode()
    for _ in range(count):
        previous = hashlib.blake2b(previous, digest_size=32).digest()
        keys.append(make_offload_key(previous, 0))
    return keys


def chunk_bytes(key: OffloadKey) -> bytes:
    """The bytes of the chunk named ``key``, a function of the key alone."""
    return hashlib.shake_256(key).digest(CHUNK_BYTES)


class TieringEngine:
    """vLLM's ``TieringOffloadingManager`` on CPU, driven as its scheduler and worker would."""

    def __init__(
        self,
        secondary_tiers: Sequence[Mapping[str, Any]],
        *,
        cpu_chunks: int = 16,
        model: str = "kvtier-test/tiny",
        step_timeout_s: float = 10.0,
        kv_events: bool = False,
    ) -> None:
        """Build vLLM's spec and manager.

        Args:
            secondary_tiers: vLLM's ``secondary_tiers`` entries (see :func:`secondary_tier`).
            cpu_chunks: Chunks the CPU primary tier holds.
            model: The model name, which goes into every key.
            step_timeout_s: How long :meth:`settle` and :meth:`lookup` step before failing.
            kv_events: Turn vLLM's KV-cache events on (``--kv-events-config``).
        """
        config = OffloadingConfig(
            groups=(
                OffloadingGroupConfig(
                    tokens_per_block=TOKENS_PER_CHUNK, layer_names=("l0",), group_id=0
                ),
            ),
            worker_kv_bytes_per_block=CHUNK_BYTES,
            enable_kv_cache_events=kv_events,
            extra_config={
                "cpu_bytes_to_use": cpu_chunks * CHUNK_BYTES,
                "secondary_tiers": [dict(tier) for tier in secondary_tiers],
            },
            engine_id=f"kvtier-test-{uuid.uuid4().hex[:12]}",
            model=OffloadingModelConfig(name=model, dtype="float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_CHUNK, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0,
                world_size=1,
                tp_size=1,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=None,
                is_parallelism_agnostic=True,
            ),
        )
        self.spec = TieringOffloadingSpec(config)
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        self._primary = manager.primary_tier.get_kv_memoryview().cast("B")
        self._step_timeout_s = step_timeout_s
        self._requests = 0

    def step(self) -> None:
        """End one scheduler step: vLLM flushes lookups and promotions and polls the tiers."""
        self.manager.on_schedule_end(_STEP)

    def settle(self) -> None:
        """Step until no transfer between the tiers is in flight."""
        deadline = time.monotonic() + self._step_timeout_s
        while True:
            self.step()
            if not self.manager.has_pending_work():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"transfers still in flight after {self._step_timeout_s:g} s of steps"
                )
            time.sleep(0.005)

    def store(self, keys: Sequence[OffloadKey]) -> None:
        """Store ``keys``' chunks in the CPU tier for a new request, then let them cascade.

        As vLLM's scheduler does, the request records each key's position (the
        token its chunk ends at), and the finished store names its keys as a set.
        """
        context = self._new_request()
        for position, key in enumerate(keys, 1):
            context.set_offload_key_position(key, position * TOKENS_PER_CHUNK)
        prepared = self.manager.prepare_store(keys, context)
        assert prepared is not None, "the CPU tier has no room for the chunks"
        spec = prepared.store_spec
        assert isinstance(spec, CPULoadStoreSpec)
        for key, chunk_id in zip(prepared.keys_to_store, spec.chunk_ids, strict=True):
            self._row(int(chunk_id))[:] = chunk_bytes(key)
        self.manager.complete_store(set(keys), context)
        self.manager.on_request_finished(context)
        self.settle()

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading chunks of ``keys`` hit, once nothing before the first miss pends.

        Looks up every key each step, as vLLM's scheduler does, so that promotions from
        the secondary tiers start together; the chunks then stay in the CPU tier.
        """
        context = self._new_request()
        deadline = time.monotonic() + self._step_timeout_s
        try:
            while True:
                hits, pending = 0, False
                for key in keys:
                    result = self.manager.lookup(key, context)
                    if result is LookupResult.MISS:
                        break
                    if result is LookupResult.HIT:
                        hits += 1
                    else:
                        pending = True
                if not pending:
                    return hits
                if time.monotonic() > deadline:
                    raise TimeoutError(f"lookups still pending after {self._step_timeout_s:g} s")
                self.step()
                time.sleep(0.005)
        finally:
            self.manager.on_request_finished(context)
            self.settle()

    def load(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        """The CPU tier's bytes of ``keys`` (all hits), read as the CPU-to-GPU copy would."""
        context = self._new_request()
        spec = self.manager.prepare_load(keys, context)
        assert isinstance(spec, CPULoadStoreSpec)
        chunks = [bytes(self._row(int(chunk_id))) for chunk_id in spec.chunk_ids]
        self.manager.complete_load(keys, context)
        self.manager.on_request_finished(context)
        return chunks

    def evict_cpu_tier(self) -> None:
        """Empty the CPU tier (vLLM's ``reset_cache``); the secondary tiers keep their chunks."""
        self.manager.reset_cache()
        if adapter_for().tiering_reset_flush:
            # What vLLM's scheduler does once every worker has dropped its copies.
            self.manager.on_reset_flushed()

    def close(self) -> None:
        """Shut the manager down: its secondary tiers, then the CPU tier."""
        self._primary.release()
        self.manager.shutdown()

    def _new_request(self) -> ReqContext:
        self._requests += 1
        context = ReqContext(req_id=f"req-{self._requests}")
        self.manager.on_new_request(context)
        return context

    def _row(self, chunk_id: int) -> memoryview:
        start = chunk_id * CHUNK_BYTES
        return self._primary[start : start + CHUNK_BYTES]
