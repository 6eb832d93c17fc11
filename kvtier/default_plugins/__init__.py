"""kvtier's built-in implementations, registered as plugins like any other: one module per kind.

:data:`kvtier.plugins.DEFAULT_PLUGINS` names these modules; each implements one
registration hook. Copy backends, layout resolvers and storage tiers register
lazy factories, so an implementation (and torch, CUDA or redis behind it) is
imported only when a config picks it; the eviction policies are pure Python.
"""
