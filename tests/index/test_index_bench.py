"""The index benchmark measures reserves that evict, for every index, and documents its output."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from kvtier.index.base import BlockKey
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from tests.conftest import REPO_ROOT, load_script

index_bench = load_script(REPO_ROOT / "benchmarks" / "index_bench.py")


@pytest.fixture(autouse=True)
def short_long_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_bench, "LONG_CHAIN_BLOCKS", 256)


def run_bench(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    index_bench.main(["--slots", "1024", "--chain-blocks", "16", "--repeats", "3", *argv])
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_every_counted_reserve_evicts(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_bench(capsys, "--index", "prefix_arc")
    for name in ("lru", "prefix_arc"):
        figures = result["indexes"][name]
        assert figures["evictions_per_reserved_key"] == 1.0
        assert figures["reserve_evict_keys_per_s"] > 0
        assert set(figures["cost_vs_lru"]) >= set(index_bench.RATE_KEYS)
    assert result["indexes"]["lru"]["first_offer_declined_fraction"] == 0.0
    assert result["indexes"]["lru"]["reserve_decline_keys_per_s"] is None


class SecondSightLRU(LRUPolicy):
    """LRU that admits a key only when it is offered a second time."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[BlockKey] = set()

    def admit(self, key: BlockKey, parent: BlockKey | None) -> bool:
        if key in self.seen:
            return True
        self.seen.add(key)
        return False


def test_a_filter_that_declines_first_sight_is_charged_for_its_evictions() -> None:
    index = PolicyIndex(64, SecondSightLRU())
    index_bench.fill(index, index_bench.make_chains(4, 16, seed=1))
    assert index.stats().free == 0
    counts = index_bench.store_round(index, index_bench.make_chains(4, 16, seed=2))
    # Every chain is declined once (timed apart), then stored, each slot evicting a key.
    assert counts["first_declined"] == counts["declined"] == 64
    assert counts["reserved"] == counts["evicted"] == 64
    assert counts["evict_s"] > 0
    assert counts["decline_s"] > 0


def test_every_output_field_is_documented(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_bench(capsys, "--index", "lru")
    documented = set(re.findall(r"``(\w+)``", index_bench.__doc__))
    fields = set(result) | set(result["targets"]) | set(result["indexes"]["lru"])
    assert fields <= documented
