"""The benchmarks' statistics: a median with its 95% interval, and the short summaries their
JSON reports.

Every interval is the order-statistic one of :func:`median_ci`: it assumes only that the
samples are independent, none of their distribution. Where values come in groups that share
an offset (the rounds of one pair of engine processes, the pairs of one prompt), the group
medians are the samples, so such a group counts once.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def median_ci(values: Sequence[float]) -> dict[str, Any]:
    """Median and its 95% order-statistic interval (binomial, normal approximation).

    The interval runs between the sorted values of ranks ``n/2 - 0.98 sqrt(n)``
    and ``n/2 + 0.98 sqrt(n)`` (clamped to the ends); with no values, every
    field is ``None`` and ``n`` is 0.
    """
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return {"median": None, "ci95": None, "n": 0}
    half = 0.98 * math.sqrt(n)
    low = max(0, math.floor(n / 2 - half))
    high = min(n - 1, math.ceil(n / 2 + half))
    return {"median": statistics.median(ordered), "ci95": [ordered[low], ordered[high]], "n": n}


def grouped_median_ci(groups: Sequence[Sequence[float]]) -> dict[str, Any]:
    """:func:`median_ci` of each group's median; of the values themselves if there is one group."""
    if len(groups) == 1:
        return median_ci(groups[0])
    return median_ci([statistics.median(group) for group in groups])


def summary(values: Sequence[float]) -> dict[str, float]:
    """The best (smallest) value and the median."""
    return {"best": min(values), "median": statistics.median(values)}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, smallest and largest value, rounded to three decimals."""
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }
