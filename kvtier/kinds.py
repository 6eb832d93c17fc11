"""The plugin kinds: one typed table shared by the registry, the config, the CLI and the docs.

Each :class:`Kind` names the hook that fills it, what one implementation is
called in messages, the config section that picks one (and the default
implementation), the factory's signature (a :class:`~typing.Protocol`) and the
type the factory builds. A kind is generic in that type, so
``registry.build(COPY_BACKEND, config.copy, layout, host_buffer)`` is typed as a
:class:`~kvtier.copy.base.CopyBackend`.

This module imports neither torch nor numpy: plugin modules and the config
loader import it before any implementation is chosen.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from kvtier.codecs.base import Codec, CodecSpec
from kvtier.copy.base import CopyBackend
from kvtier.index.base import BlockIndex
from kvtier.index.policy import EvictionPolicy, PolicyIndex
from kvtier.layout.base import KVLayout, LayoutResolver
from kvtier.models import PluginConfig

if TYPE_CHECKING:
    import torch

    from kvtier.tiers.base import StorageTier, TierSpec

BuiltT = TypeVar("BuiltT")
FactoryT = TypeVar("FactoryT", contravariant=True)


class BlockIndexFactory(Protocol):
    """``factory(config, num_slots)``: a block index for one tier; called in the scheduler.

    ``config`` is the validated instance of the registered config model and
    ``num_slots`` the tier's slot count.
    """

    def __call__(self, config: Any, num_slots: int, /) -> BlockIndex: ...


class EvictionPolicyFactory(Protocol):
    """``factory(config, num_slots)``: an eviction policy for one tier; called in the scheduler.

    ``config`` is the validated instance of the registered config model and
    ``num_slots`` the tier's slot count. kvtier puts the policy in a
    :class:`~kvtier.index.policy.PolicyIndex` (which keeps the slots, their
    states and the pins), so every eviction policy is also a block index of
    the same name and config model (see :class:`PolicyIndexFactory`).
    """

    def __call__(self, config: Any, num_slots: int, /) -> EvictionPolicy: ...


@dataclass(frozen=True)
class PolicyIndexFactory:
    """The block-index factory of a registered eviction policy: its policy in a ``PolicyIndex``."""

    policy: Callable[..., EvictionPolicy]
    """The eviction policy's registered factory."""

    def __call__(self, config: Any, num_slots: int) -> PolicyIndex:
        return PolicyIndex(num_slots, self.policy(config, num_slots))


class CopyBackendFactory(Protocol):
    """``factory(config, layout, host_buffer)``: a copy backend; called in worker processes.

    ``layout`` is the resolved :class:`~kvtier.layout.base.KVLayout` and
    ``host_buffer`` the host tier's ``[num_slots, layout.record_bytes]`` uint8 tensor.
    """

    def __call__(
        self, config: Any, layout: KVLayout, host_buffer: torch.Tensor, /
    ) -> CopyBackend: ...


class LayoutResolverFactory(Protocol):
    """``factory(config)``: a layout resolver; called in worker processes."""

    def __call__(self, config: Any, /) -> LayoutResolver: ...


class StorageTierFactory(Protocol):
    """``factory(config, spec)``: a tier below the host tier; called in workers.

    ``spec`` is a :class:`~kvtier.tiers.base.TierSpec` (record size and the
    rank's key namespace); the factory returns a
    :class:`~kvtier.tiers.base.StorageTier`.
    """

    def __call__(self, config: Any, spec: TierSpec, /) -> StorageTier: ...


class CodecFactory(Protocol):
    """``factory(config, spec)``: a record codec for one tier; called in workers, on the
    tier's construction.

    ``spec`` is a :class:`~kvtier.codecs.base.CodecSpec` (record size and what each region
    of a record holds); the factory returns a :class:`~kvtier.codecs.base.Codec`.
    """

    def __call__(self, config: Any, spec: CodecSpec, /) -> Codec: ...


class Register(Protocol[FactoryT]):
    """The ``register`` callable a registration hook receives; kvtier's core owns it.

    ``Register[CopyBackendFactory]`` checks, for a type checker, that the
    factory has the signature the hook's kind calls it with.
    """

    def __call__(self, name: str, factory: FactoryT, config_model: type[PluginConfig]) -> None:
        """Register one implementation.

        Args:
            name: What users write as ``type`` in the kind's config section.
            factory: Builds the implementation from its validated config (and the
                kind's other arguments); a :class:`LazyFactory` imports it on first use.
            config_model: A :class:`~kvtier.models.PluginConfig` subclass whose
                ``type`` field is ``Literal[name]``.
        """


@dataclass(frozen=True)
class LazyFactory:
    """A factory named by module and attribute, imported when it is first called.

    Register one for an implementation whose module is heavy (torch, CUDA
    bindings), so that loading plugins and validating a config import none of
    it: ``register("dma", LazyFactory("kvtier.copy.dma", "build_dma_backend"),
    DmaCopyConfig)``. The config model is needed to validate a config, so keep
    it in a module that is cheap to import.
    """

    module: str
    """Dotted name of the module that defines the factory."""
    attribute: str
    """Name of the factory in that module."""

    def load(self) -> Callable[..., Any]:
        """Import :attr:`module` and return the factory.

        Raises:
            ImportError: The module cannot be imported or has no such attribute.
        """
        module = importlib.import_module(self.module)
        try:
            factory: Callable[..., Any] = getattr(module, self.attribute)
        except AttributeError:
            raise ImportError(
                f"cannot import name {self.attribute!r} from {self.module!r}; the plugin that "
                "registered it names a factory its installed version does not have"
            ) from None
        return factory

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)


@dataclass(frozen=True, eq=False)
class Kind(Generic[BuiltT]):
    """One kind of plugin; ``BuiltT`` is the type its factories build."""

    name: str
    """The registry's key for the kind, as ``kvtier plugins --json`` prints it."""
    hook: str
    """The registration hook that fills it."""
    title: str
    """What one implementation is called in messages and tables."""
    builds: type
    """The type its factories build (``BuiltT`` at run time)."""
    factory: type
    """The :class:`~typing.Protocol` its factories follow."""
    description: str
    """What its implementations do, as the config reference describes its section."""
    section: str | None = None
    """The :class:`~kvtier.config.KVTierConfig` field that picks an implementation."""
    default: str | None = None
    """The implementation :attr:`section` uses when a config names none."""


BLOCK_INDEX: Kind[BlockIndex] = Kind(
    name="block_indexes",
    hook="register_block_indexes",
    title="block index",
    builds=BlockIndex,
    factory=BlockIndexFactory,
    description=(
        "Block index of the host tier: maps block keys to slots and picks eviction victims."
    ),
    section="index",
    default="prefix_arc",
)
"""Block indexes, picked by the ``index`` section; built in the scheduler process."""
COPY_BACKEND: Kind[CopyBackend] = Kind(
    name="copy_backends",
    hook="register_copy_backends",
    title="copy backend",
    builds=CopyBackend,
    factory=CopyBackendFactory,
    description="Copy backend that moves blocks between engine memory and the host tier.",
    section="copy",
    default="torch",
)
"""Copy backends, picked by the ``copy`` section; built in worker processes."""
EVICTION_POLICY: Kind[EvictionPolicy] = Kind(
    name="eviction_policies",
    hook="register_eviction_policies",
    title="eviction policy",
    builds=EvictionPolicy,
    factory=EvictionPolicyFactory,
    description=(
        "Eviction policy of a tier: ranks its readable blocks and may decline to store some; "
        "picked by the index section as a block index of the same name."
    ),
)
"""Eviction policies; each is also offered as a block index (:class:`PolicyIndexFactory`),
so the ``index`` section picks one by name. Built in the scheduler process."""
LAYOUT_RESOLVER: Kind[LayoutResolver] = Kind(
    name="layout_resolvers",
    hook="register_layout_resolvers",
    title="layout resolver",
    builds=LayoutResolver,
    factory=LayoutResolverFactory,
    description="Layout resolver that maps the engine's KV tensors to block regions.",
    section="layout",
    default="auto",
)
"""Layout resolvers, picked by the ``layout`` section; built in worker processes."""
STORAGE_TIER: Kind[object] = Kind(
    name="storage_tiers",
    hook="register_storage_tiers",
    title="storage tier",
    builds=object,
    factory=StorageTierFactory,
    description="Storage tiers below the host tier (local disk, remote stores).",
)
"""Storage tiers below the host tier, in the order the config's ``tiers`` lists them."""

RECORD_CODEC: Kind[Codec] = Kind(
    name="codecs",
    hook="register_codecs",
    title="record codec",
    builds=Codec,
    factory=CodecFactory,
    description=(
        "Record codec of a storage tier: encodes a block's bytes before the tier seals them "
        "(lossless, or opt-in lossy)."
    ),
)
"""Record codecs, picked by a storage tier's ``codec`` setting; built in worker processes."""

KINDS: tuple[Kind[Any], ...] = (
    BLOCK_INDEX,
    RECORD_CODEC,
    COPY_BACKEND,
    EVICTION_POLICY,
    LAYOUT_RESOLVER,
    STORAGE_TIER,
)
"""Every kind, in the order hooks are called, sections configured and ``kvtier plugins`` lists."""
