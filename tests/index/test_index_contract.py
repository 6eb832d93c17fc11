"""The built-in and registered block indexes against the block-index contract suite."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvtier.config import PluginConfig
from kvtier.index.base import BlockIndex
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.index.push import EvictionPushAdapter, push_evictions
from kvtier.kinds import BLOCK_INDEX
from kvtier.plugins import default_registry
from kvtier.testing.contracts_index import (
    BlockIndexContract,
    EvictionPolicyContract,
    IndexFactory,
    PolicyFactory,
)

REGISTERED = sorted(default_registry().of_kind(BLOCK_INDEX))


class TestRegisteredIndexes(BlockIndexContract):
    """Every registered block index, built from its default config."""

    @pytest.fixture(params=REGISTERED)
    def make_index(self, request: pytest.FixtureRequest) -> IndexFactory:
        registration = default_registry().get(BLOCK_INDEX, request.param)
        config: PluginConfig = registration.config_model()

        def build(num_slots: int) -> BlockIndex:
            return registration.factory(config, num_slots)

        return build


class TestBuiltInPolicies(EvictionPolicyContract):
    """The built-in eviction policies on their own: their batch calls (``admit_all``,
    ``inserted_all``, ``accessed_all``) against the per-key ones, and the policy rules."""

    @pytest.fixture(params=["lru", "arc", "s3fifo", "prefix_arc"])
    def make_policy(self, request: pytest.FixtureRequest) -> PolicyFactory:
        registration = default_registry().get(BLOCK_INDEX, request.param)
        config: PluginConfig = registration.config_model()

        def build(num_slots: int) -> Any:
            index = registration.factory(config, num_slots)
            assert isinstance(index, PolicyIndex)
            return index.policy

        return build


def test_lru_is_registered() -> None:
    assert "lru" in REGISTERED


def _delegate(name: str) -> Callable[..., Any]:
    return lambda self, *args, **kwargs: getattr(self.inner, name)(*args, **kwargs)


class KeepsEvents(BlockIndex):
    """An index written against the per-key contract: it keeps events and pushes nothing (every
    call goes to a PolicyIndex that is never told to push)."""

    def __init__(self, num_slots: int) -> None:
        self.inner = PolicyIndex(num_slots, LRUPolicy())
        self.num_slots = num_slots

    for _name in sorted(BlockIndex.__abstractmethods__):
        locals()[_name] = _delegate(_name)
    del _name


def test_an_index_that_only_keeps_events_is_wrapped_and_a_pushing_one_is_not() -> None:
    pushing = PolicyIndex(2, LRUPolicy())
    assert push_evictions(pushing, lambda keys: None, keep_events=False) is pushing
    pushed: list[bytes] = []
    wrapped = push_evictions(KeepsEvents(2), pushed.extend, keep_events=False)
    assert isinstance(wrapped, EvictionPushAdapter)
    for name in (b"a", b"b", b"c"):
        assert wrapped.reserve([name]) != [None]
        wrapped.commit([name])
    assert pushed == [b"a"] and wrapped.take_events() == []


class TestPerKeyIndexThroughTheAdapter(BlockIndexContract):
    """The per-key index above, given the pushing form by the adapter."""

    @pytest.fixture
    def make_index(self) -> IndexFactory:
        return KeepsEvents
