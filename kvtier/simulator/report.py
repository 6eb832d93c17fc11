"""Summaries of replay results: ratios to LRU and to the Belady bound, a text table, a plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.simulator.replay import ReplayResult
from kvtier.simulator.traces import TraceRequest

BELADY = "belady"
"""Name of the Belady bound in results."""
BASELINE = "lru"
"""Policy the others are compared with."""


def summarize(
    trace: str, requests: Sequence[TraceRequest], results: Sequence[ReplayResult]
) -> dict[str, Any]:
    """Collect results with each one's ratio to LRU and fraction of Belady at its capacity.

    Args:
        trace: Where the trace came from (a path or a synthetic workload name).
        requests: The replayed trace.
        results: The replays, as returned by :func:`kvtier.simulator.simulate`.

    Returns:
        A JSON-ready dict: the trace's size and one row per result, with
        ``vs_lru`` and ``of_belady`` (``None`` where that reference was not replayed).
    """
    by_key = {(r.policy, r.capacity_blocks, r.lower_tiers): r.hit_rate for r in results}
    rows = []
    for result in results:
        lru = by_key.get((BASELINE, result.capacity_blocks, result.lower_tiers))
        belady = by_key.get((BELADY, result.capacity_blocks, result.lower_tiers))
        rows.append(
            {
                **result.as_dict(),
                "vs_lru": result.hit_rate / lru if lru else None,
                "of_belady": result.hit_rate / belady if belady else None,
            }
        )
    return {
        "trace": trace,
        "requests": len(requests),
        "blocks": sum(len(request.keys) for request in requests),
        "distinct_blocks": len({key for request in requests for key in request.keys}),
        "results": rows,
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(summary: dict[str, Any]) -> str:
    """Render a summary as a Markdown table, one row per capacity and policy."""
    lines = [
        f"trace {summary['trace']}: {summary['requests']} requests, {summary['blocks']} "
        f"blocks requested, {summary['distinct_blocks']} distinct",
        "",
        "| capacity | policy | hit rate | x lru | of belady | stored | loaded | evicted "
        "| seconds |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tiered = any(row["lower_tiers"] for row in summary["results"])
    if tiered:
        lines[2] = (
            lines[2]
            .replace("| capacity |", "| capacity | below |")
            .replace("| loaded |", "| loaded | from |")
        )
        lines[3] = "|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|"
    for row in summary["results"]:
        below = ", ".join(f"{name}={blocks}" for name, blocks in row["lower_tiers"]) or "-"
        lower = sum(blocks for _, blocks in row["lower_hits"])
        sources = ", ".join(
            [f"host {row['tier_hits'] - lower}"]
            + [f"{name} {blocks}" for name, blocks in row["lower_hits"]]
        )
        lines.append(
            f"| {row['capacity_blocks']} |{f' {below} |' if tiered else ''} {row['policy']} "
            f"| {row['hit_rate']:.4f} | {_ratio(row['vs_lru'])} | {_ratio(row['of_belady'])} "
            f"| {row['stored']} | {row['tier_hits']} |{f' {sources} |' if tiered else ''} "
            f"{row['evicted']} | {row['seconds']:.2f} |"
        )
    return "\n".join(lines)


def plot_hit_rates(summary: dict[str, Any], path: str) -> None:
    """Plot hit rate against capacity (log scale), one line per policy, to a PNG file.

    Rows that carry a policy's counters over time (``--trace-state``) add one
    panel per counter below, against requests replayed, one line per policy
    and capacity.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for row in summary["results"]:
        series.setdefault(row["policy"], []).append((row["capacity_blocks"], row["hit_rate"]))
    counters = list(
        dict.fromkeys(
            name
            for row in summary["results"]
            for sample in row.get("state", ())
            for name in sample
            if name != "request"
        )
    )
    figure, panels = plt.subplots(
        1 + len(counters),
        1,
        figsize=(6.4, 4.0 + 2.2 * len(counters)),
        dpi=100,
        squeeze=False,
        gridspec_kw={"height_ratios": [1.8] + [1.0] * len(counters)},
    )
    axes = panels[0][0]
    for counter, (state_axes,) in zip(counters, panels[1:], strict=True):
        for row in summary["results"]:
            points = [(s["request"], s[counter]) for s in row.get("state", ()) if counter in s]
            if points:
                label = f"{row['policy']} @ {row['capacity_blocks']}"
                state_axes.plot(*zip(*points, strict=True), label=label, linewidth=1)
        state_axes.set_ylabel(counter, fontsize=8)
        state_axes.set_xlabel("requests replayed", fontsize=8)
        state_axes.grid(True, alpha=0.3)
        state_axes.legend(fontsize=6)
    for policy, points in series.items():
        points.sort()
        style = {"linestyle": "--", "color": "black"} if policy == BELADY else {"marker": "o"}
        axes.plot([c for c, _ in points], [h for _, h in points], label=policy, **style)
    axes.set_xscale("log")
    axes.set_xlabel("tier capacity (blocks)")
    axes.set_ylabel("prefix hit rate")
    axes.set_title(f"{Path(summary['trace']).name} ({summary['requests']} requests)", fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
