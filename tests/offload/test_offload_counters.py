"""The manager's counters: what :meth:`Counters.take_changes` hands out is the cumulative
record's gain since the last one it handed out."""

from __future__ import annotations

import logging
import random

from kvtier.index.base import IndexStats
from kvtier.offload import WorkerReport
from kvtier.offload.failures import FailureCause
from kvtier.offload.stats import OFFLOAD_COUNTERS, CounterKind, Counters

COUNTERS = [each.name for each in OFFLOAD_COUNTERS if each.kind is CounterKind.COUNTER]


def test_take_changes_is_the_records_gain_since_the_last_one_taken() -> None:
    """Random steps change counters, tier counts, tier gauges, failures and usage (or
    nothing); each take equals ``record().since(last record taken)``, or ``None`` when
    the two records are equal."""
    rng = random.Random(7)
    counters = Counters(record_observations=False, logger=logging.getLogger(__name__))
    usage = {"readable": 0, "quarantined": 0}

    def index_stats() -> IndexStats:
        return IndexStats(num_slots=64, free=0, writing=1, readable=usage["readable"], pinned=0)

    last = counters.record(index_stats(), 0)
    taken = nothing = 0
    for step in range(400):
        change = rng.randrange(7)
        if change == 0:
            counters.add(rng.choice(COUNTERS), rng.randint(1, 5))
        elif change == 1:
            counters.add_tier_counts({rng.choice("ab"): {"reads": 1, "errors.timeout": 2}})
        elif change == 2:
            gauges = {"queued": rng.randint(0, 1), "state": rng.randint(0, 2)}
            counters.set_tier_gauges([WorkerReport(tier_gauges={"a": gauges})])
        elif change == 3:
            counters.failures.failed(rng.choice(list(FailureCause)), "failed")
        elif change == 4:
            usage["readable"] = rng.randint(0, 3)
        elif change == 5:
            usage["quarantined"] = rng.randint(0, 1)
        state = (usage["readable"], usage["quarantined"], step if change == 6 else 0)
        got = counters.take_changes(
            state, lambda: counters.gauges(index_stats(), usage["quarantined"])
        )
        now = counters.record(index_stats(), usage["quarantined"])
        if now == last:
            assert got is None, step
            nothing += 1
        else:
            assert got == now.since(last), step
            last = now
            taken += 1
    assert taken > 100 and nothing > 20  # both answers were checked often
    again = counters.take_changes(
        state, lambda: counters.gauges(index_stats(), usage["quarantined"])
    )
    assert again is None  # nothing changed since the last take
