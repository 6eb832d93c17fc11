"""Hook specifications: the registration hooks every kvtier plugin implements.

Each hook receives a ``register`` callable owned by kvtier's core::

    register(name: str, factory: Callable[..., T], config_model: type[PluginConfig])

``name`` is the value users write as ``type`` in the matching config section;
``config_model`` is a :class:`kvtier.api.PluginConfig` subclass whose ``type``
field is ``Literal[name]``. kvtier rejects a second registration of the same
name, naming both plugins. All hooks run once, in the process that builds the
plugin manager (the scheduler and every worker each build their own), in the
order of :data:`kvtier.kinds.KINDS`.
"""

from __future__ import annotations

import pluggy

from kvtier.kinds import (
    BlockIndexFactory,
    CodecFactory,
    CopyBackendFactory,
    EvictionPolicyFactory,
    LayoutResolverFactory,
    Register,
    StorageTierFactory,
)

hookspec = pluggy.HookspecMarker("kvtier")


@hookspec
def register_block_indexes(register: Register[BlockIndexFactory]) -> None:
    """Register block indexes (key to slot directories with an eviction policy).

    The factory is called as ``factory(config, num_slots)`` with the validated
    config model and the tier's slot count, and returns a
    :class:`kvtier.index.BlockIndex`. Called in the scheduler process.

    :param register: ``register(name, factory, config_model)``; call it once per index.
    :return: Nothing; a return value is ignored.
    """


@hookspec
def register_copy_backends(register: Register[CopyBackendFactory]) -> None:
    """Register copy backends that move blocks between engine memory and host slots.

    The factory is called as ``factory(config, layout, host_buffer)`` with the
    validated config model, the resolved :class:`~kvtier.layout.KVLayout` and the
    host tier's ``[num_slots, record_bytes]`` uint8 tensor, and returns a
    :class:`kvtier.copy.CopyBackend`. Called in worker processes.

    :param register: ``register(name, factory, config_model)``; call it once per backend.
    :return: Nothing; a return value is ignored.
    """


@hookspec
def register_eviction_policies(register: Register[EvictionPolicyFactory]) -> None:
    """Register eviction policies: what a tier evicts when it is full, and what it declines.

    The factory is called as ``factory(config, num_slots)`` with the validated
    config model and the tier's slot count, and returns a
    :class:`kvtier.index.EvictionPolicy`. kvtier puts it in a
    :class:`kvtier.index.PolicyIndex`, which keeps the slots, their states and
    the pins, and offers it as a block index of the same name, so ``index.type``
    picks it; a name may not be both a block index and a policy. kvtier's own
    ``lru``, ``arc``, ``s3fifo`` and ``prefix_arc`` are registered here. Called
    in the scheduler process.

    :param register: ``register(name, factory, config_model)``; call it once per policy.
    :return: Nothing; a return value is ignored.
    """


@hookspec
def register_layout_resolvers(register: Register[LayoutResolverFactory]) -> None:
    """Register layout resolvers: engine KV tensors in, a :class:`~kvtier.layout.KVLayout` out.

    The factory is called as ``factory(config)`` with the validated config model
    and returns a :class:`kvtier.layout.LayoutResolver`. Called in worker processes.

    :param register: ``register(name, factory, config_model)``; call it once per resolver.
    :return: Nothing; a return value is ignored.
    """


@hookspec
def register_storage_tiers(register: Register[StorageTierFactory]) -> None:
    """Register storage tiers that sit below the host tier (local disk, remote stores).

    The factory is called as ``factory(config, spec)`` with the validated
    config model and a :class:`kvtier.tiers.base.TierSpec` (the size of one
    block record in bytes and the rank's :class:`~kvtier.keys.KeyNamespace`,
    with rank and world size), and returns a
    :class:`kvtier.tiers.base.StorageTier`, or raises
    :class:`kvtier.tiers.base.TierError` naming why the tier cannot start.
    kvtier's own ``disk`` and ``redis`` tiers are registered here. The
    config's ``tiers`` list picks them by name, in lookup order. Called in
    worker processes.

    :param register: ``register(name, factory, config_model)``; call it once per tier.
    :return: Nothing; a return value is ignored.
    """


@hookspec
def register_codecs(register: Register[CodecFactory]) -> None:
    """Register record codecs: what a storage tier does to a block's bytes before sealing them.

    The factory is called as ``factory(config, spec)`` with the validated config
    model and a :class:`kvtier.codecs.CodecSpec` (the record size and, from the
    layout resolver, what each region of a record holds), and returns a
    :class:`kvtier.codecs.Codec`. A storage tier's ``codec`` setting picks one
    by name; its encode and decode run on the tier's I/O threads. kvtier's own
    ``lossless``, ``fp8`` and ``int8`` are registered here. Called in worker
    processes.

    :param register: ``register(name, factory, config_model)``; call it once per codec.
    :return: Nothing; a return value is ignored.
    """
