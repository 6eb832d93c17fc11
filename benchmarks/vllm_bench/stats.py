"""Statistics of the vLLM benchmarks: summaries, and a 95% interval of a median drawn by a
two-level bootstrap (groups, then values within each group)."""

from __future__ import annotations

import math
import random
import statistics


def summary(values: list[float]) -> dict[str, float]:
    return {"best": min(values), "median": statistics.median(values)}


BOOTSTRAP_RESAMPLES = 4000


def percentiles_95(medians: list[float]) -> list[float]:
    """The 2.5th and 97.5th percentiles of bootstrap medians."""
    ordered = sorted(medians)
    last = len(ordered) - 1
    return [ordered[int(0.025 * last)], ordered[int(math.ceil(0.975 * last))]]


def median_interval(groups: list[list[float]]) -> list[float]:
    """A 95% interval of the median of the values of ``groups``, from a two-level bootstrap.

    Each of :data:`BOOTSTRAP_RESAMPLES` resamplings (with replacement, fixed
    seed) draws groups, then values within each drawn group, so a group whose
    values share an offset (one pair of engine processes, one prompt) weighs
    on the interval as one sample, not as many; the interval is the 2.5th and
    97.5th percentiles of the resamplings' medians.
    """
    rng = random.Random(0)
    return percentiles_95(
        [
            statistics.median(
                value
                for group in rng.choices(groups, k=len(groups))
                for value in rng.choices(group, k=len(group))
            )
            for _ in range(BOOTSTRAP_RESAMPLES)
        ]
    )
