"""Tests of the ``fifo`` eviction policy and its registration through the ``kvtier`` entry point."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from kvtier_example import FIFOConfig, build_fifo_policy

from kvtier.api import BLOCK_INDEX, EVICTION_POLICY, PolicyIndex
from kvtier.config import ConfigError, load_config
from kvtier.plugins import build_plugin_manager, collect
from kvtier.testing.contracts_index import EvictionPolicyContract, PolicyFactory


class TestFIFOContract(EvictionPolicyContract):
    """kvtier's eviction-policy contract suite, run on both variants of the policy."""

    @pytest.fixture(params=[False, True], ids=["plain", "second-chance"])
    def make_policy(self, request: pytest.FixtureRequest) -> PolicyFactory:
        config = FIFOConfig(second_chance=request.param)
        return lambda num_slots: build_fifo_policy(config, num_slots)


def build_fifo_index(config: FIFOConfig, num_slots: int) -> PolicyIndex:
    """The ``fifo`` policy in the index kvtier puts it in."""
    return PolicyIndex(num_slots, build_fifo_policy(config, num_slots))


def keys(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


def store(index, *names: str) -> None:
    assert all(slot is not None for slot in index.reserve(keys(*names)))
    index.commit(keys(*names))


def readable(index, *names: str) -> list[str]:
    return [name for name in names if index.slot_of(name.encode()) is not None]


def test_plain_fifo_evicts_in_store_order_even_after_hits() -> None:
    index = build_fifo_index(FIFOConfig(), num_slots=3)
    store(index, "a", "b", "c")
    index.pin(keys("a"))
    index.unpin(keys("a"))
    store(index, "d")
    assert readable(index, "a", "b", "c", "d") == ["b", "c", "d"]


def test_second_chance_keeps_a_block_hit_since_it_was_stored() -> None:
    index = build_fifo_index(FIFOConfig(second_chance=True), num_slots=3)
    store(index, "a", "b", "c")
    index.touch(keys("a"))
    store(index, "d")
    assert readable(index, "a", "b", "c", "d") == ["a", "c", "d"]
    store(index, "e")
    assert readable(index, "a", "b", "c", "d", "e") == ["a", "d", "e"]


def test_pinned_blocks_are_never_evicted() -> None:
    for second_chance in (False, True):
        index = build_fifo_index(FIFOConfig(second_chance=second_chance), num_slots=2)
        store(index, "a", "b")
        index.pin(keys("a", "b"))
        assert index.reserve(keys("c")) == [None]
        index.unpin(keys("b"))
        store(index, "c")
        assert readable(index, "a", "b", "c") == ["a", "c"]


def test_events_report_stores_and_evictions_in_order() -> None:
    index = build_fifo_index(FIFOConfig(), num_slots=1)
    store(index, "a")
    store(index, "b")
    assert [(event.kind.value, event.key) for event in index.take_events()] == [
        ("stored", b"a"),
        ("evicted", b"a"),
        ("stored", b"b"),
    ]


def test_entry_point_registers_fifo_with_its_distribution() -> None:
    names = {ep.value for ep in entry_points(group="kvtier")}
    assert "kvtier_example.plugin" in names
    registry = collect(build_plugin_manager(env={"KVTIER_LOAD_PLUGINS": "kvtier-example"}))
    for kind in (EVICTION_POLICY, BLOCK_INDEX):  # a policy is also a block index of its name
        registration = registry.get(kind, "fifo")
        assert (registration.distribution, registration.config_model) == (
            "kvtier-example",
            FIFOConfig,
        )


def test_config_selects_and_validates_fifo() -> None:
    registry = collect(build_plugin_manager(env={"KVTIER_LOAD_PLUGINS": "kvtier-example"}))
    config = load_config(
        {"index": {"type": "fifo", "second_chance": "yes"}}, env={}, registry=registry
    )
    assert config.index == FIFOConfig(second_chance=True)
    with pytest.raises(ConfigError) as caught:
        load_config(
            {"index": {"type": "fifo", "second_chance": "often"}}, env={}, registry=registry
        )
    assert caught.value.lines == [
        "explicit: index.second_chance: Input should be a valid boolean, unable to interpret "
        "input (got 'often')"
    ]
