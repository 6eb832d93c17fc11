"""Everything a kvtier plugin needs, from one module that imports neither torch nor numpy.

A plugin module writes ``from kvtier.api import ...`` and nothing else from kvtier:

- :data:`hookimpl` marks the registration hooks (:mod:`kvtier.hookspecs`);
  each receives a :class:`Register` callable;
- :class:`PluginConfig` is the base of an implementation's config model; a
  storage tier's config that names the store it writes is a :class:`NamesItsStore`;
- the contracts an implementation fulfils: :class:`EvictionPolicy` (kvtier
  puts it in a :class:`PolicyIndex`) or a whole :class:`BlockIndex`, :class:`CopyBackend`,
  :class:`LayoutResolver`, with the types they exchange;
- the factory signatures, one :class:`~typing.Protocol` per kind
  (:class:`BlockIndexFactory`, :class:`CopyBackendFactory`,
  :class:`EvictionPolicyFactory`, :class:`LayoutResolverFactory`,
  :class:`StorageTierFactory`, :class:`CodecFactory`), and
  :class:`LazyFactory` to import a heavy implementation only when it is chosen;
- a record codec's contract, :class:`Codec`, with :class:`CodecSpec`,
  :class:`ErrorBound` and :class:`CodecError`;
- the kinds (:data:`BLOCK_INDEX`, :data:`COPY_BACKEND`, :data:`EVICTION_POLICY`,
  :data:`LAYOUT_RESOLVER`, :data:`STORAGE_TIER`, :data:`RECORD_CODEC`) for
  ``registry.get(EVICTION_POLICY, "fifo")`` in a plugin's tests.
"""

from kvtier import hookimpl
from kvtier.codecs.base import Codec, CodecError, CodecSpec, ErrorBound
from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction
from kvtier.index.base import BlockIndex, BlockKey, EventKind, IndexEvent, IndexStats
from kvtier.index.policy import EvictionPolicy, PolicyIndex
from kvtier.kinds import (
    BLOCK_INDEX,
    COPY_BACKEND,
    EVICTION_POLICY,
    LAYOUT_RESOLVER,
    RECORD_CODEC,
    STORAGE_TIER,
    BlockIndexFactory,
    CodecFactory,
    CopyBackendFactory,
    EvictionPolicyFactory,
    Kind,
    LayoutResolverFactory,
    LazyFactory,
    Register,
    StorageTierFactory,
)
from kvtier.layout.base import (
    BlockRegion,
    KVCaches,
    KVLayout,
    LayoutError,
    LayoutResolver,
    RecordRegion,
    RegionFormat,
)
from kvtier.models import NamesItsStore, PluginConfig

__all__ = [
    "BLOCK_INDEX",
    "RECORD_CODEC",
    "COPY_BACKEND",
    "EVICTION_POLICY",
    "LAYOUT_RESOLVER",
    "STORAGE_TIER",
    "BlockIndex",
    "BlockIndexFactory",
    "BlockKey",
    "BlockRegion",
    "Codec",
    "CodecError",
    "CodecFactory",
    "CodecSpec",
    "CopyBackend",
    "CopyBackendFactory",
    "CopyBatch",
    "CopyError",
    "CopyHandle",
    "Direction",
    "ErrorBound",
    "EventKind",
    "EvictionPolicy",
    "EvictionPolicyFactory",
    "IndexEvent",
    "IndexStats",
    "KVCaches",
    "KVLayout",
    "Kind",
    "LayoutError",
    "LayoutResolver",
    "LayoutResolverFactory",
    "LazyFactory",
    "NamesItsStore",
    "PluginConfig",
    "PolicyIndex",
    "RecordRegion",
    "RegionFormat",
    "Register",
    "StorageTierFactory",
    "hookimpl",
]
