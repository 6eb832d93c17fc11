"""kvtier's storage tiers below vLLM's own CPU offloading tier: secondary tiers of its tiering.

vLLM's ``OffloadingConnector`` with the ``TieringOffloadingSpec`` keeps KV
chunks in a CPU primary tier and cascades them to *secondary tiers*, which it
loads by class name and ``module_path``. :class:`KVTierSecondaryTier` is one:
it runs any kvtier storage tier (``disk``, ``redis``, or a plugin's) below
vLLM's CPU tier. One entry of ``secondary_tiers`` names one kvtier tier::

    {"type": "KVTierSecondaryTier",
     "module_path": "kvtier.integrations.vllm.tiering",
     "tier": {"type": "disk", "path": "/var/cache/kvtier", "capacity_bytes": "100GiB"}}

``tier`` is validated by the tier's own config model (one line per problem,
as everywhere in kvtier); ``namespace`` (optional) is the tenant namespace of
kvtier's config; ``locality``, ``backpressure`` and ``enable_kv_events`` are
vLLM's own settings, as its ``fs`` and ``obj`` tiers take them. Any other key
of the entry is a config error line, like a bad key inside ``tier``.

vLLM calls a secondary tier in its scheduler process only, and every call must
return at once. The primitives, in the order vLLM calls them:

1. ``lookup(key)`` answers from a cache of presence checks; a key not checked
   yet is ``RETRY``, and the checks queued during a step run together on a
   thread (vLLM's ``AsyncLookupManager``) after ``on_schedule_end``.
2. ``submit_store(job)`` hands the job's primary-tier chunks to the kvtier
   tier's ``put`` (vLLM keeps them pinned until the job finishes), in prefix
   order: vLLM hands a job's keys as a set, and records each key's position
   in the request, which orders them (a tier that packs neighbours, as the
   ``s3`` tier does, then cuts every engine's prefix at the same keys).
3. ``submit_load(job)`` queues a ``get``; the tier's I/O thread copies each
   record it returns into the job's primary-tier chunk. A record that fails
   its header checks, or its MAC under the tier's keys, is a miss and is
   never copied; the job then reports the keys it did load.
4. ``get_finished_jobs()`` returns the jobs whose futures completed;
   ``drain_jobs()`` waits for all of them.
5. ``get_stats()`` reports the kvtier tier's counters as vLLM tiering metrics;
   with ``enable_kv_events`` (and vLLM's KV-cache events on),
   ``take_events()`` returns a stored event of the keys of each store job the
   tier stored.
6. ``shutdown()`` waits for the jobs, then closes the tier.

Each record holds one primary-tier chunk: the bytes of every worker's share
of the chunk's blocks, as vLLM lays them out in its CPU tier. The records are
namespaced by the model and a fingerprint of that layout, so engines whose
chunks differ never read each other's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.config import ConfigError, KVTierConfig, Problem, load_config
from kvtier.index.base import BlockKey
from kvtier.integrations.vllm.stats import METRICS, PROMETHEUS_PREFIX
from kvtier.keys import KeyNamespace
from kvtier.offload.stats import TIER_COUNTERS, tier_counts
from kvtier.plugins import default_registry
from kvtier.tiers.base import GetResult, PutResult
from kvtier.tiers.chain import TierChain

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

TIER_LABEL = "tier"
"""The label of kvtier's per-tier metrics: the kvtier tier's name (``disk``, ``redis``)."""


def tier_config(tier: Mapping[str, Any] | None, namespace: str, tier_type: str) -> KVTierConfig:
    """Validate one secondary tier's kvtier settings: the storage tier and the tenant namespace.

    Args:
        tier: The ``tier`` entry of vLLM's tier config: a kvtier storage-tier config.
        namespace: Tenant namespace of every key ("" for none).
        tier_type: The entry's ``type`` in vLLM's config, named in error lines.

    Raises:
        ConfigError: One line per problem, as ``vLLM secondary tier <type>: tier.<path>: ...``.
    """
    source = _source(tier_type)
    if tier is None:
        raise ConfigError(
            [
                Problem(
                    source,
                    "tier",
                    "required: the kvtier storage tier to run, e.g. "
                    '{"type": "disk", "path": ..., "capacity_bytes": ...}',
                    has_value=False,
                )
            ]
        )
    try:
        return load_config(
            {"tiers": [tier], "namespace": namespace},
            env={},
            registry=default_registry(),
        )
    except ConfigError as exc:
        raise ConfigError(
            [
                Problem(
                    source,
                    _vllm_path(problem.path),
                    problem.message,
                    problem.value,
                    problem.has_value,
                )
                for problem in exc.problems
            ]
        ) from None


def _source(tier_type: str) -> str:
    """Where a problem of this entry of vLLM's ``secondary_tiers`` is, in error lines."""
    return f"vLLM secondary tier {tier_type}"


def _locality(locality: str | None, tier_type: str) -> Locality | None:
    """vLLM's ``locality`` setting of this entry; ``None`` when it is not set."""
    if locality is None:
        return None
    choices = [choice.value for choice in Locality]
    if locality not in choices:
        raise ConfigError(
            [
                Problem(
                    _source(tier_type),
                    "locality",
                    f"expected one of {', '.join(choices)}",
                    locality,
                )
            ]
        )
    return Locality(locality)


ENTRY_KEYS = (
    "type",
    "module_path",
    "tier",
    "namespace",
    "locality",
    "backpressure",
    "enable_kv_events",
)
"""The keys of one entry of vLLM's ``secondary_tiers`` that runs a kvtier tier."""


def _no_other_keys(unknown: Mapping[str, Any], tier_type: str) -> None:
    """Raise a config error line for each key of the entry it does not take."""
    if unknown:
        raise ConfigError(
            [
                Problem(
                    _source(tier_type),
                    name,
                    f"unknown key; valid keys here: {', '.join(ENTRY_KEYS)}",
                    value,
                )
                for name, value in unknown.items()
            ]
        )


def _vllm_path(path: str) -> str:
    """``tiers[0].path`` (kvtier's config) as ``tier.path`` (this entry of vLLM's config)."""
    for kvtier_path in ("tiers[0]", "tiers"):
        if path.startswith(kvtier_path):
            return "tier" + path[len(kvtier_path) :]
    return path


def chunk_layout_fingerprint(offloading_spec: OffloadingSpec, chunk_bytes: int) -> str:
    """A digest of everything that decides what a primary-tier chunk's bytes mean.

    Two engines share records only when their chunks hold the same blocks, of the
    same layers, in the same byte layout: same dtype, block and chunk sizes,
    groups and parallelism.
    """
    config = offloading_spec.config
    parallel = config.parallel
    facts = {
        "chunk_bytes": chunk_bytes,
        "dtype": config.model.dtype,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[group.tokens_per_block, list(group.layer_names)] for group in config.groups],
        "parallel": [
            parallel.world_size,
            parallel.tp_size,
            parallel.pp_size,
            parallel.pcp_size,
            parallel.dcp_size,
        ],
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
    }
    text = json.dumps(facts, sort_keys=True)
    return "vllm-tiering:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class _PresenceChecks(AsyncLookupManager):
    """vLLM's batched, non-blocking lookups, answered by the kvtier tier's ``contains``."""

    def __init__(self, owner: KVTierSecondaryTier) -> None:
        super().__init__(tier_type=owner.tier_type)
        self._owner = owner

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        # Runs on the lookup thread; the tier answers by its get deadline at the latest.
        answer = self._owner.tier.contains(self._owner.tier_keys(keys)).result()
        return answer.present


class KVTierSecondaryTier(SecondaryTierManager):
    """A kvtier storage tier as a secondary tier of vLLM's ``TieringOffloadingManager``.

    See the module docstring for the config and the protocol.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        tier: Mapping[str, Any] | None = None,
        namespace: str = "",
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        enable_kv_events: bool = False,
        **unknown: Any,
    ) -> None:
        """Validate ``tier``, then build the kvtier tier for this engine's chunks.

        Args:
            offloading_spec: vLLM's offloading spec; its config names the model and layout.
            primary_kv_view: The CPU primary tier's buffer, one row per chunk.
            tier_type: This entry's ``type`` in vLLM's config.
            tier: The kvtier storage-tier config (``type`` and the tier's settings).
            namespace: Tenant namespace mixed into every key ("" for none).
            locality: ``LOCAL`` or ``REMOTE``; by default ``REMOTE`` for a tier other
                processes share (Redis), ``LOCAL`` otherwise.
            backpressure_detector: vLLM's detector, built from this entry's ``backpressure``.
            enable_kv_events: Publish a stored event for the chunks each store job
                stored, when vLLM's KV-cache events are on.
            unknown: Any other key of the entry: each is a config error line.

        Raises:
            kvtier.config.ConfigError: ``tier``, ``namespace``, ``locality`` or
                ``enable_kv_events`` is invalid, or the entry has another key.
            kvtier.tiers.TierError: The tier cannot start.
        """
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        _no_other_keys(unknown, tier_type)
        config = tier_config(tier, namespace, tier_type)
        self.locality = _locality(locality, tier_type)
        self._events = _events(enable_kv_events, offloading_spec, tier_type)
        keys = KeyNamespace(
            offloading_spec.config.model.name,
            chunk_layout_fingerprint(offloading_spec, self.block_size_bytes),
            rank=0,
            world_size=1,
        )
        self._chain = TierChain.from_config(
            config, record_bytes=self.block_size_bytes, keys=keys, registry=default_registry()
        )
        self.tier_name, self.tier = self._chain.tiers[0]
        if self.locality is None:
            self.locality = Locality.REMOTE if self.tier.shared else Locality.LOCAL
        if self.tier.shared:
            self.cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED
        # One flat byte view of the primary tier: chunk c is bytes [c * size, (c + 1) * size).
        self._primary = primary_kv_view.cast("B")
        self._done_lock = threading.Condition()
        self._in_flight = 0
        self._finished: list[tuple[JobResult, Sequence[OffloadKey], Sequence[OffloadKey]]] = []
        self._lookups = _PresenceChecks(self)
        logger.info(
            "kvtier %s tier runs below vLLM's CPU tier as secondary tier %s (%s, %d-byte chunks)",
            self.tier_name,
            tier_type,
            self.locality.value,
            self.block_size_bytes,
        )

    # ------------------------------------------------------------------ vLLM's calls

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        present = self._lookups.lookup(key, req_context)
        if present is None:
            return LookupResult.RETRY
        return LookupResult.HIT if present else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, chunk_ids = _prefix_order(job_metadata)
        records = [self._chunk(chunk_id) for chunk_id in chunk_ids]
        started = time.monotonic()
        future = self._start(lambda: self.tier.put(self.tier_keys(keys), records))
        future.add_done_callback(
            lambda done: self._finish(
                self._stored(job_metadata.job_id, done, started), (), self._stored_keys(keys, done)
            )
        )

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = list(job_metadata.chunk_ids)
        started = time.monotonic()
        future = self._start(lambda: self.tier.get(self.tier_keys(keys)))
        future.add_done_callback(
            lambda done: self._loaded(job_metadata.job_id, keys, chunk_ids, done, started)
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._done_lock:
            finished, self._finished = self._finished, []
        for _, failed_keys, stored_keys in finished:
            if failed_keys:
                # The presence check said yes but the record did not come back (damaged,
                # forged, evicted): stop offering it, or vLLM would promote it again.
                self._lookups.mark_miss(failed_keys)
            if stored_keys and self._events is not None:
                self._events.append(
                    OffloadingEvent(
                        keys=list(stored_keys),
                        medium=self.medium,
                        removed=False,
                        locality=self.locality,
                    )
                )
        return [result for result, _, _ in finished]

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        events, self._events = self._events, []
        return events

    def has_pending_work(self) -> bool:
        with self._done_lock:
            return self._in_flight > 0 or bool(self._finished)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        with self._done_lock:
            self._done_lock.wait_for(lambda: self._in_flight == 0)

    def shutdown(self) -> None:
        self.drain_jobs()
        self._lookups.shutdown()
        self._chain.close()
        self._primary.release()

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        names = [f"tier_{counter.name}" for counter in TIER_COUNTERS]
        return {
            PROMETHEUS_PREFIX + name: OffloadingCounterMetadata(
                documentation=METRICS[name].documentation, labelnames=(TIER_LABEL,)
            )
            for name in names
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        grown = self._chain.take_counts().get(self.tier_name)
        if not grown:
            return None
        stats = OffloadingConnectorStats()
        label = (self.tier_name,)
        for name, value in tier_counts(grown).items():
            if value:
                stats.increase_counter(f"{PROMETHEUS_PREFIX}tier_{name}", value, label)
        return None if stats.is_empty() else stats

    # ------------------------------------------------------------------ internal

    def tier_keys(self, keys: Sequence[OffloadKey]) -> list[BlockKey]:
        """The kvtier tier's keys of vLLM's chunk keys (a block hash and a group each)."""
        return [
            self.tier.keys.key(get_offload_block_hash(key), get_offload_group_idx(key))
            for key in keys
        ]

    def _chunk(self, chunk_id: int) -> memoryview:
        start = int(chunk_id) * self.block_size_bytes
        return self._primary[start : start + self.block_size_bytes]

    def _start(self, submit: Callable[[], Future[Any]]) -> Future[Any]:
        with self._done_lock:
            self._in_flight += 1
        try:
            return submit()
        except BaseException:
            with self._done_lock:
                self._in_flight -= 1
            raise

    def _finish(
        self,
        result: JobResult,
        failed_keys: Sequence[OffloadKey],
        stored_keys: Sequence[OffloadKey] = (),
    ) -> None:
        with self._done_lock:
            self._finished.append((result, failed_keys, stored_keys))
            self._in_flight -= 1
            self._done_lock.notify_all()

    def _stored(self, job_id: int, done: Future[PutResult], started: float) -> JobResult:
        stored = done.result().stored
        return JobResult(
            job_id=job_id,
            success=all(stored),
            transfer_time=time.monotonic() - started,
            transfer_bytes=sum(stored) * self.block_size_bytes,
        )

    def _stored_keys(
        self, keys: Sequence[OffloadKey], done: Future[PutResult]
    ) -> Sequence[OffloadKey]:
        """The keys of a store job that the tier stored, when events are published."""
        if self._events is None:
            return ()
        return [key for key, stored in zip(keys, done.result().stored, strict=True) if stored]

    def _loaded(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        chunk_ids: Sequence[int],
        done: Future[GetResult],
        started: float,
    ) -> None:
        # Runs on the tier's I/O thread that answered the get; on the scheduler's thread
        # only when the get was answered before submit_load attached this callback (at
        # once, as misses, when the tier's queue is full).
        loaded: list[OffloadKey] = []
        failed: list[OffloadKey] = []
        try:
            for key, chunk_id, record in zip(keys, chunk_ids, done.result().records, strict=True):
                if record is None:
                    failed.append(key)
                    continue
                self._chunk(chunk_id)[:] = record
                loaded.append(key)
        except Exception:  # a fault here must still finish the job, or vLLM would wait forever
            logger.exception(
                "kvtier %s tier: copying a load into vLLM's CPU tier failed", self.tier_name
            )
            failed, loaded = list(keys), []
        success = not failed
        self._finish(
            JobResult(
                job_id=job_id,
                success=success,
                successful_keys=None if success or not loaded else tuple(loaded),
                transfer_time=time.monotonic() - started,
                transfer_bytes=len(loaded) * self.block_size_bytes,
            ),
            failed,
        )


def _events(
    enabled: object, offloading_spec: OffloadingSpec, tier_type: str
) -> list[OffloadingEvent] | None:
    """The list a tier collects its events in; ``None`` when it publishes none.

    Raises:
        ConfigError: ``enabled`` is not a boolean.
    """
    if not isinstance(enabled, bool):
        raise ConfigError(
            [Problem(_source(tier_type), "enable_kv_events", "expected true or false", enabled)]
        )
    if not enabled:
        return None
    if not offloading_spec.kv_events_config.enable_kv_cache_events:
        logger.warning(
            "vLLM secondary tier %s: enable_kv_events is set but vLLM's KV-cache events are "
            "off (--kv-events-config); the tier publishes no events",
            tier_type,
        )
        return None
    return []


def _prefix_order(job: TransferJob) -> tuple[list[OffloadKey], list[int]]:
    """A store job's keys and chunks in prefix order: by kv-cache group, then by the position
    vLLM recorded for each key in its request (a key without one keeps its place after
    those with one)."""
    paired = list(zip(job.keys, job.chunk_ids, strict=True))
    context = job.req_context
    last = float("inf")

    def place(pair: tuple[OffloadKey, int]) -> tuple[int, float]:
        position = context.get_offload_key_position(pair[0])
        return get_offload_group_idx(pair[0]), last if position is None else position

    paired.sort(key=place)
    return [key for key, _ in paired], [int(chunk_id) for _, chunk_id in paired]
