"""The cost guard: its cost estimates, and the loads and tier reads it skips or lets through."""

from __future__ import annotations

import logging

import pytest

from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.keys import KeyNamespace, hash_token_blocks
from kvtier.offload import OffloadManager, WorkerReport
from kvtier.offload.costguard import MIN_SAMPLES, PROBE_EVERY, CostGuard, CostModel
from kvtier.offload.stats import Counters
from kvtier.tiers import TierSpec
from kvtier.tiers.chain import TierChain
from tests.support.tiers import MemoryTier

BLOCK_TOKENS = 16
PER_TOKEN_S = 1e-4
"""The prefill cost the tests' engine measures: 1.6 ms per block of recompute."""


def timed_prefill(timed: CostGuard | OffloadManager, steps: int = MIN_SAMPLES) -> None:
    """Steps of 1 and 100 tokens, each 5 ms plus ``PER_TOKEN_S`` a token."""
    for i in range(steps):
        tokens = 100 if i % 2 else 1
        timed.step_timed(tokens, 0.005 + PER_TOKEN_S * tokens)


def loads(blocks: int, seconds: float, count: int = MIN_SAMPLES) -> WorkerReport:
    return WorkerReport(load_times=((blocks, seconds),) * count)


def reads(tier: str, records: int, seconds: float, count: int = MIN_SAMPLES) -> WorkerReport:
    return WorkerReport(read_times={tier: ((records, seconds),) * count})


def make_guard(**settings: object) -> CostGuard:
    counters = Counters(record_observations=True, logger=logging.getLogger(__name__))
    settings = {"enabled": True, "block_tokens": BLOCK_TOKENS, **settings}
    return CostGuard(counters, **settings)  # type: ignore[arg-type]


def test_a_cost_model_predicts_nothing_until_warm_then_fits_the_line() -> None:
    model = CostModel()
    for blocks in range(1, MIN_SAMPLES):
        model.add(blocks, 0.010 + 0.002 * blocks)
    assert model.predict(4) is None
    model.add(MIN_SAMPLES, 0.010 + 0.002 * MIN_SAMPLES)
    fixed_s, per_unit_s = model.fit()  # type: ignore[misc]
    assert fixed_s == pytest.approx(0.010) and per_unit_s == pytest.approx(0.002)
    assert model.predict(10) == pytest.approx(0.030)


def test_a_cost_model_without_spread_in_sizes_is_proportional_or_fixed() -> None:
    same, misses = CostModel(), CostModel()
    for _ in range(MIN_SAMPLES):
        same.add(4, 0.008)
        misses.add(0, 0.3)
    assert same.fit() == pytest.approx((0.0, 0.002))
    assert misses.fit() == pytest.approx((0.3, 0.0)), "reads that found nothing: latency"


def test_a_cost_model_whose_cost_does_not_grow_with_size_is_a_fixed_cost() -> None:
    """Probes (no record) and small reads that take the same time: a latency, not a cost
    per record spread over the probes' sizes of zero."""
    model = CostModel()
    for i in range(4 * MIN_SAMPLES):
        model.add(4 if i % 8 == 0 else 0, 0.002 if i % 8 == 0 else 0.0025)
    fixed_s, per_unit_s = model.fit()  # type: ignore[misc]
    assert per_unit_s == 0.0
    assert model.predict(9) == pytest.approx(fixed_s) and 0.002 < fixed_s < 0.0025


def test_a_prefill_cost_that_does_not_grow_with_tokens_is_not_free() -> None:
    """Step times of a loaded machine that do not grow with the tokens computed: recomputing
    stays priced per token (a per-token cost of 0 would skip every load)."""
    model = CostModel(grows=True)
    for i in range(4 * MIN_SAMPLES):
        model.add(1024 if i % 2 else 32, 0.004 if i % 2 else 0.005)
    fixed_s, per_unit_s = model.fit()  # type: ignore[misc]
    assert fixed_s == 0.0 and per_unit_s > 0
    assert model.predict(528) == pytest.approx(0.0045, rel=0.05)


def test_a_cost_model_follows_what_changed() -> None:
    model = CostModel()
    for _ in range(50):
        model.add(4, 4.0)
    for _ in range(400):  # 12.5 half-lives
        model.add(4, 0.004)
    assert model.predict(4) == pytest.approx(0.004, rel=0.2)


def test_a_slow_host_load_is_skipped_and_counted_once_per_request() -> None:
    guard = make_guard()
    timed_prefill(guard)
    guard.measured([loads(4, 1.0)])
    assert not guard.load_host_hit("r", 4)
    assert not guard.load_host_hit("r", 4), "asked again: the same answer"
    assert guard.counters.values["guard_skipped_tokens"] == 4 * BLOCK_TOKENS
    observations = guard.counters.observations
    assert observations.guard_load_seconds == [pytest.approx(1.0)]
    assert observations.guard_recompute_seconds == [pytest.approx(4 * BLOCK_TOKENS * PER_TOKEN_S)]
    guard.forget("r")
    assert not guard.load_host_hit("r", 4)
    assert guard.counters.values["guard_skipped_tokens"] == 8 * BLOCK_TOKENS


def test_a_fast_host_load_goes_ahead() -> None:
    guard = make_guard()
    timed_prefill(guard)
    guard.measured([loads(4, 1e-4)])
    assert guard.load_host_hit("r", 4)
    assert guard.counters.values["guard_skipped_tokens"] == 0


def test_nothing_is_skipped_before_every_cost_is_measured_or_with_the_guard_off() -> None:
    warming = make_guard()
    timed_prefill(warming)
    warming.measured([loads(4, 1.0, count=MIN_SAMPLES - 1)])
    assert warming.load_host_hit("r", 4), "the host load is not measured enough yet"
    no_prefill = make_guard()
    timed_prefill(no_prefill, steps=MIN_SAMPLES - 1)
    no_prefill.measured([loads(4, 1.0)])
    assert no_prefill.load_host_hit("r", 4), "the prefill is not measured enough yet"
    off = make_guard(enabled=False)
    timed_prefill(off)
    off.measured([loads(4, 1.0)])
    assert off.load_host_hit("r", 4)
    assert off.costs[""].samples == off.prefill.samples == 0, "off, it measures nothing"


def test_after_a_run_of_skips_one_load_goes_ahead_to_measure_again() -> None:
    guard = make_guard()
    timed_prefill(guard)
    guard.measured([loads(4, 1.0)])
    answers = [guard.load_host_hit(f"r{i}", 4) for i in range(2 * PROBE_EVERY + 2)]
    assert answers.count(True) == 2
    assert answers[PROBE_EVERY] and answers[2 * PROBE_EVERY + 1]


def test_a_margin_above_one_loads_more() -> None:
    recompute_s = 4 * BLOCK_TOKENS * PER_TOKEN_S
    strict, lenient = make_guard(), make_guard(margin=2.0)
    for guard in (strict, lenient):
        timed_prefill(guard)
        guard.measured([loads(4, 1.5 * recompute_s)])
    assert not strict.load_host_hit("r", 4)
    assert lenient.load_host_hit("r", 4)
    with pytest.raises(ValueError, match="margin must be positive"):
        make_guard(margin=0)


def test_only_the_slow_tiers_reads_are_skipped_and_counted_per_tier() -> None:
    guard = make_guard(tier_names=("disk", "redis", "s3"))
    timed_prefill(guard)
    guard.measured([loads(4, 1e-4), reads("disk", 4, 1e-3), reads("redis", 4, 0.5)])
    assert guard.skipped_tiers(4) == {"redis"}, "s3 is not measured yet: it is read"
    assert guard.counters.tiers == {"redis": {"guard_skipped_records": 4}}


def lower_tier_manager(*tier_names: str) -> OffloadManager:
    return OffloadManager(
        PolicyIndex(16, LRUPolicy()),
        block_tokens=BLOCK_TOKENS,
        record_bytes=64,
        write_policies=("write_back",) * len(tier_names),
        cost_guard=True,
        tier_names=tier_names,
    )


def test_a_host_miss_is_not_promoted_from_a_tier_measured_slow() -> None:
    manager = lower_tier_manager("slow")
    timed_prefill(manager)
    manager.process(reads("slow", 4, 0.3))
    hashes = hash_token_blocks(list(range(4 * BLOCK_TOKENS + 1)), BLOCK_TOKENS)
    assert manager.lookup("r", hashes, 0, 4 * BLOCK_TOKENS + 1) == 0, "no wait: a miss"
    assert manager.build_plan().promotions == ()
    assert manager.stats().tiers == {"slow": {"guard_skipped_records": 4}}


def test_a_promotion_skips_the_slow_tier_and_reads_the_fast_one() -> None:
    manager = lower_tier_manager("slow", "fast")
    timed_prefill(manager)
    manager.process(reads("slow", 4, 0.3).merge(reads("fast", 4, 1e-4)))
    hashes = hash_token_blocks(list(range(4 * BLOCK_TOKENS + 1)), BLOCK_TOKENS)
    assert manager.lookup("r", hashes, 0, 4 * BLOCK_TOKENS + 1) is None
    (promotion,) = manager.build_plan().promotions
    assert promotion.skip_tiers == {"slow"}


def test_reports_carry_timings_that_merge_but_do_not_make_reports_differ() -> None:
    merged = loads(2, 0.1, count=1).merge(loads(3, 0.2, count=1))
    merged = merged.merge(reads("disk", 1, 0.01, count=1)).merge(reads("disk", 2, 0.02, count=1))
    assert merged.load_times == ((2, 0.1), (3, 0.2))
    assert merged.read_times == {"disk": ((1, 0.01), (2, 0.02))}
    assert not merged.empty
    assert merged == WorkerReport(), "timings are measurements, not outcomes"


def test_a_fetch_skips_the_tiers_named_and_times_the_reads_it_makes() -> None:
    spec = TierSpec(64, KeyNamespace("model", "layout", 0, 1))
    first, second = MemoryTier(spec), MemoryTier(spec)
    chain = TierChain([("first", first), ("second", second)])
    hashes = [bytes([i]) * 8 for i in range(3)]
    second.put(second.keys.keys(hashes, 0), [bytes(64)] * 3).result()
    skipping = chain.fetch(0, hashes, frozenset({"second"}))
    assert skipping.wait(5) and skipping.records == []
    assert chain.take_read_times().keys() == {"first"}
    fetch = chain.fetch(0, hashes)
    assert fetch.wait(5) and fetch.sources == ["second"] * 3
    times = chain.take_read_times()
    assert [found for found, _ in times["first"]] == [0]
    assert [found for found, _ in times["second"]] == [3]
    chain.close()
