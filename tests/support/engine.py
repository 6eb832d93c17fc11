"""A synthetic inference engine: paged KV tensors in any built-in layout, for end-to-end tests.

:class:`SyntheticEngine` allocates KV-cache tensors shaped and strided like a
real engine's (:data:`LAYOUTS` lists them), keeps a free list and a prefix
cache of its device blocks, and "computes" a block by filling it with values
derived from the block's key, the layer (or state tensor) and the position of
each element. Filling and checking go through the engine's own tensor
indexing, never through the resolved :class:`~kvtier.layout.KVLayout`, so a
wrong layout, a wrong copy or a block loaded into the wrong place all show up
as a mismatch.

:class:`OffloadedEngine` wires a synthetic engine to the scheduler-side
:class:`~kvtier.offload.OffloadManager`, driven through an
:class:`~kvtier.offload.session.OffloadSession`, and ``world_size`` workers
(:class:`~kvtier.offload.OffloadWorker`) the way an engine integration does,
and runs requests step by step: prefix hits in the engine, then in the tier
(loaded asynchronously), stores of computed blocks, and release of finished
requests' blocks once every worker reported their copies. It uses the same
engine-neutral helpers an engine integration does: a
:class:`~kvtier.offload.EvictionFrontier` over its free list and a
:class:`~kvtier.offload.protection.LazyStoreGuard` for lazy stores, the
workers' :meth:`~kvtier.offload.OffloadWorker.take_load_failures`, and the
session's tokens for KV-cache events.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.config.model import (
    DEFAULT_CLOSE_TIMEOUT_S,
    DEFAULT_COPY_DEADLINE_S,
    DEFAULT_REPORT_DEADLINE_S,
    PrefetchConfig,
)
from kvtier.index.base import BlockIndex, BlockKey
from kvtier.keys import hash_token_blocks
from kvtier.kinds import LAYOUT_RESOLVER
from kvtier.layout.base import KVCaches, KVLayout, LayoutResolver
from kvtier.offload.events import BlockEvent
from kvtier.offload.manager import OffloadManager
from kvtier.offload.messages import LazyCandidate, TransferPlan, WorkerReport
from kvtier.offload.protection import LazyStoreGuard
from kvtier.offload.session import OffloadSession
from kvtier.offload.setup import StoreMode
from kvtier.offload.worker import BackendFactory, OffloadWorker
from kvtier.testing.contracts_layout import mamba_state_views
from kvtier.tiers.chain import TierChain
from kvtier.tiers.host import HostTier

logger = logging.getLogger(__name__)

LAYOUTS: tuple[str, ...] = (
    "flash_attn_nhd",
    "flash_attn_hnd",
    "flashinfer",
    "mla",
    "cpu",
    "cross_layer",
    "mamba",
    "shared_layers",
)
"""Tensor layouts :func:`make_kv_caches` builds:

- ``flash_attn_nhd``: vLLM FlashAttention, one ``(2, nb, bs, H, D)`` tensor per layer.
- ``flash_attn_hnd``: the same logical shape stored in ``(2, nb, H, bs, D)`` order.
- ``flashinfer``: ``(nb, 2, bs, H, D)`` per layer.
- ``mla``: ``(nb, bs, 576)`` per layer (one latent vector per token).
- ``cpu``: vLLM's CPU backend, ``(nb, H, bs, 2 * D)`` per layer.
- ``cross_layer``: one ``(nb, L, 2, bs, H, D)`` tensor; each layer gets its ``[:, layer]`` view.
- ``mamba``: per layer a list of state tensors (conv, ssm) inside one padded page per block.
- ``shared_layers``: FlashAttention tensors where each pair of layers shares one tensor.
"""

MLA_DIM = 576
"""Elements per token of an MLA latent cache (512 latent + 64 rotary)."""


@dataclass(frozen=True)
class EngineSpec:
    """Shape of a synthetic engine's KV cache."""

    layout: str = "flash_attn_nhd"
    """One of :data:`LAYOUTS`."""
    num_blocks: int = 32
    """Device blocks per layer."""
    block_tokens: int = 4
    """Tokens per block."""
    num_layers: int = 2
    """Attention (or Mamba) layers."""
    num_kv_heads: int = 2
    """KV heads per layer."""
    head_dim: int = 8
    """Elements per head."""
    dtype: torch.dtype = torch.float16
    """Element type of every tensor."""
    device: str = "cpu"
    """Torch device of the tensors."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown synthetic layout {self.layout!r}; choose from {LAYOUTS}")
        if min(self.num_blocks, self.block_tokens, self.num_layers) <= 0:
            raise ValueError(f"an engine spec needs positive sizes, got {self}")


@dataclass(frozen=True)
class EngineTensor:
    """A logical tensor the engine fills: ``tensor.select(block_dim, block)`` is one block."""

    name: str
    tensor: torch.Tensor
    block_dim: int


def make_kv_caches(spec: EngineSpec) -> tuple[KVCaches, list[EngineTensor]]:
    """Allocate KV tensors for ``spec``.

    Returns:
        ``(kv_caches, tensors)``: what the engine hands to a layout resolver
        (layer name -> tensor or list of state tensors), and the distinct
        logical tensors whose blocks hold data (shared storage appears once).
    """
    nb, bs, heads, dim = spec.num_blocks, spec.block_tokens, spec.num_kv_heads, spec.head_dim

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=spec.dtype, device=spec.device)

    layers = [f"layers.{index}.attn" for index in range(spec.num_layers)]
    caches: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    tensors: list[EngineTensor] = []
    if spec.layout in ("flash_attn_nhd", "shared_layers"):
        for index, name in enumerate(layers):
            if spec.layout == "shared_layers" and index % 2 == 1:
                caches[name] = caches[layers[index - 1]]
                continue
            tensor = zeros(2, nb, bs, heads, dim)
            caches[name] = tensor
            tensors.append(EngineTensor(name, tensor, 1))
    elif spec.layout == "flash_attn_hnd":
        for name in layers:
            physical = zeros(2, nb, heads, bs, dim)
            tensor = physical.permute(0, 1, 3, 2, 4)
            caches[name] = tensor
            tensors.append(EngineTensor(name, tensor, 1))
    elif spec.layout in ("flashinfer", "mla", "cpu"):
        shape = {
            "flashinfer": (nb, 2, bs, heads, dim),
            "mla": (nb, bs, MLA_DIM),
            "cpu": (nb, heads, bs, 2 * dim),
        }[spec.layout]
        for name in layers:
            tensor = zeros(*shape)
            caches[name] = tensor
            tensors.append(EngineTensor(name, tensor, 0))
    elif spec.layout == "cross_layer":
        shared = zeros(nb, spec.num_layers, 2, bs, heads, dim)
        for index, name in enumerate(layers):
            view = shared[:, index]
            caches[name] = view
            tensors.append(EngineTensor(name, view, 0))
    else:
        for name in layers:
            states = _mamba_states(spec)
            caches[name] = states
            tensors.extend(EngineTensor(f"{name}.{i}", state, 0) for i, state in enumerate(states))
    return caches, tensors


def _mamba_states(spec: EngineSpec) -> list[torch.Tensor]:
    """Conv and SSM states of one Mamba layer, packed in one padded page per block."""
    element = spec.dtype.itemsize
    conv_shape = (spec.num_kv_heads * spec.head_dim, 3)
    ssm_shape = (spec.num_kv_heads, spec.head_dim, 4)
    conv_bytes = element * conv_shape[0] * conv_shape[1]
    ssm_bytes = element * ssm_shape[0] * ssm_shape[1] * ssm_shape[2]
    page_bytes = -(-(conv_bytes + ssm_bytes + 64) // 256) * 256
    pages = torch.zeros((spec.num_blocks, page_bytes), dtype=torch.uint8, device=spec.device)
    return mamba_state_views(pages, (conv_shape, ssm_shape), (spec.dtype, spec.dtype))


def _seed(key: BlockKey, tensor_index: int) -> int:
    digest = hashlib.blake2b(key, digest_size=8, person=tensor_index.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little") >> 2


def block_values(
    key: BlockKey, tensor_index: int, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """The contents of one block of one tensor for ``key``: exact small integers in ``dtype``.

    Every element depends on the key, the tensor and its position, and is
    exactly representable in every float type (including 8-bit ones), so a
    byte comparison after any round trip is exact.
    """
    levels = 8 if dtype.itemsize == 1 and dtype.is_floating_point else 128
    count = 1
    for size in shape:
        count *= size
    positions = torch.arange(count, dtype=torch.int64)
    mixed = (positions * 0x9E3779B1 + _seed(key, tensor_index)) % (2**61 - 1)
    mixed = (mixed * 0x85EBCA6B) % (2**61 - 1)
    return (mixed % levels).reshape(tuple(shape)).to(dtype)


@functools.lru_cache(maxsize=4096)
def _shared_block_values(
    key: BlockKey, tensor_index: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """:func:`block_values`, computed once per argument set: engines only read the result."""
    return block_values(key, tensor_index, shape, dtype)


class SyntheticEngine:
    """Paged KV tensors with a free list and a prefix cache of device blocks."""

    def __init__(self, spec: EngineSpec, resolver: LayoutResolver | None = None) -> None:
        """Allocate the KV cache and resolve its layout.

        Args:
            spec: The cache's shape.
            resolver: Layout resolver; the registered ``auto`` resolver if ``None``.
        """
        self.spec = spec
        self.kv_caches, self._tensors = make_kv_caches(spec)
        if resolver is None:
            from kvtier.plugins import default_registry

            registration = default_registry().get(LAYOUT_RESOLVER, "auto")
            resolver = registration.factory(registration.config_model.model_validate({}))
        self.layout: KVLayout = resolver.resolve(self.kv_caches)
        if self.layout.num_blocks != spec.num_blocks:
            raise AssertionError(
                f"the resolver found {self.layout.num_blocks} blocks in a cache of "
                f"{spec.num_blocks}: the layout is wrong"
            )
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(spec.num_blocks))
        self._cached: dict[BlockKey, int] = {}
        self._block_key: dict[int, BlockKey] = {}
        self._refs = [0] * spec.num_blocks
        self._offered: set[int] = set()

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated (free, possibly still caching a key)."""
        return len(self._free)

    def prefix_hits(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the engine's own cache holds."""
        hits = 0
        for key in keys:
            if key not in self._cached:
                break
            hits += 1
        return hits

    def cached_block(self, key: BlockKey) -> int:
        """The device block caching ``key``; ``KeyError`` if none does."""
        return self._cached[key]

    def acquire_cached(self, keys: Sequence[BlockKey]) -> list[int]:
        """Take a reference on the cached blocks of ``keys`` (engine prefix hits)."""
        blocks = [self._cached[key] for key in keys]
        for block in blocks:
            self._ref(block)
        return blocks

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks, evicting their cached keys (oldest freed first).

        Raises:
            MemoryError: If fewer than ``count`` blocks are free.
        """
        if count > len(self._free):
            raise MemoryError(f"need {count} device blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; unreferenced blocks join the free list."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise AssertionError(f"device block {block} freed more often than taken")
            if self._refs[block] == 0:
                self._free[block] = None

    def cache(self, block: int, key: BlockKey) -> None:
        """Record that ``block`` holds ``key`` (computed or loaded)."""
        self._forget(block)
        if key in self._cached:
            return
        self._cached[key] = block
        self._block_key[block] = key

    @property
    def first_free(self) -> int:
        """The free block allocated next (``-1`` when none is free)."""
        return next(iter(self._free), -1)

    def eviction_frontier(self, count: int) -> list[tuple[BlockKey, int]]:
        """Cached blocks among the ``count`` free blocks that would be reused next.

        Each block is offered once until its contents change (a cursor, as an
        engine walking its free queue keeps), so an idle engine stops offering.
        """
        frontier = []
        for position, block in enumerate(self._free):
            if position == count:
                break
            key = self._block_key.get(block)
            if key is not None and block not in self._offered:
                self._offered.add(block)
                frontier.append((key, block))
        return frontier

    def protect(self, blocks: Sequence[int]) -> None:
        """Keep free blocks from reuse (a lazy store reads them) until :meth:`free`."""
        for block in blocks:
            self._ref(block)

    def compute(self, block: int, key: BlockKey) -> None:
        """Write ``key``'s values into ``block`` in every tensor and cache it."""
        for index, item in enumerate(self._tensors):
            target = item.tensor.select(item.block_dim, block)
            target.copy_(_shared_block_values(key, index, tuple(target.shape), target.dtype))
        self.cache(block, key)

    def mismatches(self, block: int, key: BlockKey) -> list[str]:
        """Names of the tensors whose ``block`` does not hold exactly ``key``'s values."""
        wrong = []
        for index, item in enumerate(self._tensors):
            actual = item.tensor.select(item.block_dim, block)
            expected = _shared_block_values(key, index, tuple(actual.shape), actual.dtype)
            if not torch.equal(
                actual.contiguous().view(torch.uint8).cpu(), expected.contiguous().view(torch.uint8)
            ):
                wrong.append(item.name)
        return wrong

    def drop_cache(self) -> None:
        """Forget and overwrite every free block, as a burst of other traffic would."""
        for block in list(self._free):
            self.scramble(block)

    def scramble(self, block: int) -> None:
        """Overwrite ``block`` with noise, as reuse by another request would."""
        self._forget(block)
        for item in self._tensors:
            target = item.tensor.select(item.block_dim, block)
            target.copy_(torch.full(target.shape, 3, dtype=torch.int64).to(target.dtype))

    def is_free(self, block: int) -> bool:
        """Whether no request (or copy) holds ``block``."""
        return self._refs[block] == 0

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            self._free.pop(block, None)
        self._refs[block] += 1

    def _forget(self, block: int) -> None:
        self._offered.discard(block)
        key = self._block_key.pop(block, None)
        if key is not None and self._cached.get(key) == block:
            del self._cached[key]


@dataclass
class _Running:
    request_id: str
    tokens: list[int]
    keys: list[BlockKey]
    blocks: list[int]
    computed_tokens: int
    steps_left: int
    loading: bool = False
    loaded_from: int = 0
    loaded: list[tuple[int, BlockKey]] = field(default_factory=list)


@dataclass
class RunStats:
    """What an :class:`OffloadedEngine` run saw."""

    requests: int = 0
    """Requests admitted (a preempted request counts again when readmitted)."""
    engine_hit_blocks: int = 0
    """Blocks found in the engine's own prefix cache."""
    tier_hit_blocks: int = 0
    """Blocks loaded from the host tier."""
    verified_blocks: int = 0
    """Loaded blocks whose bytes were checked on every rank."""
    relocated_blocks: int = 0
    """Verified loaded blocks that landed in another device block than they were computed in."""
    failed_load_blocks: int = 0
    """Loaded blocks a worker reported as failed (recomputed)."""
    preemptions: int = 0
    """Requests preempted."""


class _Frontier:
    """The eviction frontier of rank 0's engine (every rank's engine frees the same blocks)."""

    def __init__(self, engine: SyntheticEngine, count: int) -> None:
        self.engine = engine
        self.count = count

    def signature(self) -> tuple[int, int]:
        return self.engine.num_free, self.engine.first_free

    def blocks(self) -> list[tuple[int, BlockKey]]:
        return [(block, key) for key, block in self.engine.eviction_frontier(self.count)]

    def candidate(self, block_id: int, contents: Hashable) -> LazyCandidate:
        assert isinstance(contents, bytes)
        return LazyCandidate(contents, 0, block_id)


class OffloadedEngine:
    """A synthetic engine driving an offload manager and ``world_size`` workers.

    Every worker has its own engine (as each rank of a tensor-parallel engine
    holds its shard) and runs the same plans; the ranks allocate identically.
    Engine keys are the chained token hashes of
    :func:`~kvtier.keys.hash_token_blocks`. A request is prefilled in one step
    and then decodes for ``decode_steps`` steps without new blocks; tier hits
    are loaded before it computes, and every loaded block is checked byte for
    byte on every rank (:attr:`mismatches` lists the wrong ones).
    :meth:`silence` withholds a worker's reports for some steps, as a rank
    that stops reporting (and may come back) would. With ``record_events``,
    :attr:`events` collects the tiers' KV-cache events with each stored
    block's tokens (the lower tiers' with chains built with ``report_blocks``).
    """

    def __init__(
        self,
        spec: EngineSpec,
        index: BlockIndex,
        backend_factory: BackendFactory,
        *,
        world_size: int = 1,
        store_mode: StoreMode = "eager",
        late_worker: int | None = None,
        record_events: bool = False,
        resolver: LayoutResolver | None = None,
        copy_deadline_s: float = DEFAULT_COPY_DEADLINE_S,
        report_deadline_s: float = DEFAULT_REPORT_DEADLINE_S,
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        chains: Sequence[TierChain] | None = None,
        prefetch: PrefetchConfig | None = None,
    ) -> None:
        """Build the engines (one per worker), the manager and the workers.

        Args:
            spec: Shape of each rank's KV cache.
            index: The host tier's block index (its slot count sizes every host tier).
            backend_factory: Builds each worker's copy backend.
            world_size: Number of workers.
            store_mode: The manager's store mode.
            late_worker: A worker whose reports reach the manager one step late.
            record_events: Collect the tiers' KV-cache events in :attr:`events`.
            resolver: Layout resolver (registered ``auto`` if ``None``).
            copy_deadline_s: The workers' copy deadline.
            report_deadline_s: The manager's report deadline.
            close_timeout_s: How long :meth:`close` lets each worker wait for copies.
            clock: Time for the manager's and the workers' deadlines.
            sleep: How workers pause while they wait for copies.
            chains: Each worker's tiers below the host tier (one chain per worker).
            prefetch: The manager's prefetch settings (``None``: their defaults).
        """
        self.spec = spec
        self.engines = [SyntheticEngine(spec, resolver) for _ in range(world_size)]
        record_bytes = self.engines[0].layout.record_bytes
        self.manager = OffloadManager(
            index,
            block_tokens=spec.block_tokens,
            record_bytes=record_bytes,
            world_size=world_size,
            store_mode=store_mode,
            record_events=record_events,
            report_deadline_s=report_deadline_s,
            write_policies=() if chains is None else chains[0].write_policies,
            clock=clock,
            prefetch=prefetch,
        )
        self.session = OffloadSession(self.manager)
        self.guard = LazyStoreGuard(self.manager)
        self._frontier = _Frontier(self.engines[0], max(1, spec.num_blocks // 4))
        self.events: list[BlockEvent] = []
        self.workers = [
            OffloadWorker(
                engine.layout,
                HostTier(index.num_slots, record_bytes),
                backend_factory,
                copy_deadline_s=copy_deadline_s,
                close_timeout_s=close_timeout_s,
                chain=None if chains is None else chains[rank],
                clock=clock,
                sleep=sleep,
            )
            for rank, engine in enumerate(self.engines)
        ]
        self.late_worker = late_worker
        self._silent_steps = [0] * world_size
        self._withheld: list[list[WorkerReport]] = [[] for _ in range(world_size)]
        self.stats = RunStats()
        self.mismatches: list[str] = []
        self._late_reports: list[WorkerReport | None] = []
        self._waiting: list[tuple[list[int], int, str]] = []
        self._salts: dict[str, bytes] = {}
        self._preempted: set[str] = set()
        self._running: dict[str, _Running] = {}
        self._held: dict[str, list[int]] = {}
        self._next_request = 0
        self._computed_in: dict[BlockKey, int] = {}
        self.last_plan = TransferPlan()

    @property
    def engine(self) -> SyntheticEngine:
        """Rank 0's engine (every rank's engine holds the same blocks)."""
        return self.engines[0]

    @property
    def running(self) -> list[str]:
        """Ids of the admitted, unfinished requests."""
        return list(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests submitted (or preempted) and not admitted yet."""
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """Whether nothing waits, runs, is held, is in flight, quarantined or unreported."""
        return not (
            self._waiting
            or self._running
            or self._held
            or self.manager.num_inflight_batches
            or self.manager.num_quarantined_batches
            or any(self._silent_steps)
            or any(self._withheld)
        )

    def silence(self, rank: int, steps: int) -> None:
        """Withhold worker ``rank``'s reports for the next ``steps`` steps, then deliver them."""
        self._silent_steps[rank] = max(self._silent_steps[rank], steps)

    def submit(
        self, tokens: Sequence[int], decode_steps: int = 1, *, salt: bytes | None = None
    ) -> str:
        """Queue a request, and return its id; it is admitted by a later :meth:`step` once its
        blocks fit. The session hears of it now (:meth:`OffloadSession.arrived
        <kvtier.offload.session.OffloadSession.arrived>`). ``salt``: its tenant's salt (the
        engine's own prefix cache ignores it, as the tiers' keys do: only sealing differs)."""
        blocks = -(-len(tokens) // self.spec.block_tokens)
        if blocks > self.spec.num_blocks // 2:
            raise ValueError(f"a request of {blocks} blocks never fits in this engine")
        request_id = f"req-{self._next_request}"
        self._next_request += 1
        self._waiting.append((list(tokens), decode_steps, request_id))
        keys = hash_token_blocks(tokens, self.spec.block_tokens)
        if salt is not None:
            self._salts[request_id] = salt
        self.session.arrived(request_id, keys, len(tokens), salt=salt)
        return request_id

    def abort(self, request_id: str) -> None:
        """Take a request out of the queue before it was admitted, as a client's abort does."""
        self._waiting = [entry for entry in self._waiting if entry[2] != request_id]
        self.session.finished(request_id, 0)

    def step(self, preempt: Sequence[str] = ()) -> None:
        """Run one engine step: admit, plan, preempt, copy, compute, report, finish."""
        preempted = [
            self._running.pop(rid)
            for rid in preempt
            if rid in self._running and not self._running[rid].loading
        ]
        session = self.session
        session.preempted(state.request_id for state in preempted)
        while self._waiting and self._admit(*self._waiting[0]):
            self._waiting.pop(0)
        plan = session.plan(frontier=self._frontier)
        self.last_plan = plan
        for ref in self.guard.protect(plan):
            for engine in self.engines:
                engine.protect([ref.block_id])
        for worker in self.workers:
            worker.bind(plan)
            worker.handle_preemptions()
        for state in preempted:
            self._requeue(state)
        for state in self._running.values():
            if not state.loading:
                self._compute(state)
        self._collect()
        for request_id, state in list(self._running.items()):
            if state.loading:
                continue
            if state.steps_left <= 0:
                self._finish(request_id)
            else:
                session.scheduled(request_id, num_computed_tokens=state.computed_tokens)
        self.events.extend(session.take_events())

    def drain(self, max_steps: int = 200) -> None:
        """Step until nothing waits, runs, is held or is in flight.

        Raises:
            AssertionError: If that takes more than ``max_steps`` steps.
        """
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
        raise AssertionError(
            f"not drained after {max_steps} steps: {len(self._waiting)} waiting, "
            f"{len(self._running)} running, {len(self._held)} held, "
            f"{self.manager.num_inflight_batches} batches in flight, "
            f"{self.manager.num_quarantined_batches} quarantined"
        )

    def close(self) -> None:
        """Close every worker."""
        for worker in self.workers:
            worker.close()

    def _admit(self, tokens: list[int], decode_steps: int, request_id: str) -> bool:
        spec = self.spec
        keys = hash_token_blocks(tokens, spec.block_tokens)
        engine_hits = min(self.engine.prefix_hits(keys), (len(tokens) - 1) // spec.block_tokens)
        total_blocks = -(-len(tokens) // spec.block_tokens)
        hits_now_free = sum(
            self.engine.is_free(self.engine.cached_block(k)) for k in keys[:engine_hits]
        )
        if self.engine.num_free - hits_now_free < total_blocks - engine_hits:
            return False
        computed = engine_hits * spec.block_tokens
        salt = self._salts.get(request_id)
        tier_tokens, _ = self.session.lookup(request_id, keys, computed, len(tokens), salt=salt)
        if tier_tokens is None:
            return False  # the lower tiers are being searched: ask again next step
        tier_hits = tier_tokens // spec.block_tokens
        acquired = [engine.acquire_cached(keys[:engine_hits]) for engine in self.engines]
        allocated = [engine.allocate(total_blocks - engine_hits) for engine in self.engines]
        for rank in range(1, len(self.engines)):
            if (acquired[rank], allocated[rank]) != (acquired[0], allocated[0]):
                raise AssertionError(f"rank {rank} allocated different device blocks than rank 0")
        blocks = acquired[0] + allocated[0]
        self.session.allocated(request_id, keys, [blocks], tier_tokens, token_ids=tokens)
        self.session.scheduled(
            request_id,
            num_computed_tokens=computed,
            new_block_ids=[blocks],
            block_hashes=keys,
            resumed=request_id in self._preempted,
        )
        state = _Running(request_id, tokens, keys, blocks, computed, decode_steps)
        if tier_hits:
            state.loading = True
            state.loaded_from = engine_hits
            state.loaded = [
                (blocks[pos], keys[pos]) for pos in range(engine_hits, engine_hits + tier_hits)
            ]
        self._running[request_id] = state
        self.stats.requests += 1
        self.stats.engine_hit_blocks += engine_hits
        self.stats.tier_hit_blocks += tier_hits
        return True

    def _compute(self, state: _Running) -> None:
        first = state.computed_tokens // self.spec.block_tokens
        for position in range(first, len(state.keys)):
            for engine in self.engines:
                engine.compute(state.blocks[position], state.keys[position])
            self._computed_in[state.keys[position]] = state.blocks[position]
        state.computed_tokens = len(state.keys) * self.spec.block_tokens
        state.steps_left -= 1

    def _collect(self) -> None:
        reports: list[WorkerReport | None] = []
        failed_blocks: set[int] = set()
        for rank, worker in enumerate(self.workers):
            _, loaded = worker.get_finished()
            failed_blocks |= worker.take_load_failures(loaded).blocks
            report = worker.take_report()
            if rank == self.late_worker:
                self._late_reports.append(report)
                report = self._late_reports.pop(0) if len(self._late_reports) > 1 else None
            if self._silent_steps[rank]:
                self._silent_steps[rank] -= 1
                if report is not None:
                    self._withheld[rank].append(report)
                report = None
            elif self._withheld[rank]:
                report = WorkerReport.merge_all([*self._withheld[rank], report])
                self._withheld[rank] = []
            reports.append(report)
        progress = self.session.process(reports)
        for request_id in progress.loaded_requests:
            failed = {ref.block_id for ref in progress.failed_loads.get(request_id, ())}
            self._finish_load(request_id, failed | failed_blocks)
        for ref in self.guard.release(progress):
            for engine in self.engines:
                engine.free([ref.block_id])
        for request_id in progress.released_requests:
            blocks = self._held.pop(request_id)
            for engine in self.engines:
                engine.free(blocks)

    def _finish_load(self, request_id: str, failed_blocks: set[int]) -> None:
        state = self._running.get(request_id)
        if state is None:
            return
        state.loading = False
        good = 0
        for block, key in state.loaded:
            if block in failed_blocks:
                self.stats.failed_load_blocks += 1
                break
            for rank, engine in enumerate(self.engines):
                wrong = engine.mismatches(block, key)
                if wrong:
                    line = f"{request_id} rank {rank} block {block} key {key.hex()[:12]}: {wrong}"
                    logger.warning("loaded block holds wrong bytes: %s", line)
                    self.mismatches.append(line)
                engine.cache(block, key)
            self.stats.verified_blocks += 1
            if self._computed_in.get(key) != block:
                self.stats.relocated_blocks += 1
            good += 1
        state.computed_tokens = (state.loaded_from + good) * self.spec.block_tokens
        self.session.scheduled(request_id, num_computed_tokens=state.computed_tokens)

    def _requeue(self, state: _Running) -> None:
        """Give a preempted request's blocks back (they are reused at once) and queue it again."""
        self.stats.preemptions += 1
        for engine in self.engines:
            engine.free(state.blocks)
            for block in state.blocks:
                if engine.is_free(block):
                    engine.scramble(block)
        self._preempted.add(state.request_id)
        self._waiting.insert(0, (state.tokens, max(1, state.steps_left), state.request_id))

    def _finish(self, request_id: str) -> None:
        state = self._running.pop(request_id)
        self._salts.pop(request_id, None)
        if self.session.finished(request_id, state.computed_tokens):
            self._held[request_id] = state.blocks
        else:
            for engine in self.engines:
                engine.free(state.blocks)
