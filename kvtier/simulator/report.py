"""Summaries of replay results: ratios to LRU and to the Belady bound, a text table, a plot.

Fleet replays (:mod:`kvtier.simulator.fleet`) have their own summary, table and plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.simulator.fleet import FleetRun
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


def trace_seconds(requests: Sequence[TraceRequest]) -> float:
    """The trace's span from its first to its last timestamp, in seconds."""
    stamps = [request.timestamp_ms for request in requests]
    return (max(stamps) - min(stamps)) / 1000 if stamps else 0.0


def _per_second(blocks: int, seconds: float, block_bytes: int | None) -> dict[str, float | None]:
    return {
        "blocks_per_s": blocks / seconds if seconds else None,
        "bytes_per_s": blocks * block_bytes / seconds if seconds and block_bytes else None,
    }


def summarize_fleet(
    trace: str,
    requests: Sequence[TraceRequest],
    runs: Sequence[FleetRun],
    block_bytes: int | None = None,
) -> dict[str, Any]:
    """Collect fleet replays with each shared tier's reads and writes per second of trace time.

    Args:
        trace: Where the trace came from (a path or a synthetic workload name).
        requests: The replayed trace.
        runs: The replays, as returned by :func:`kvtier.simulator.fleet.simulate_fleet`.
        block_bytes: Bytes per block, for bytes per second (``None``: blocks only).

    Returns:
        A JSON-ready dict: the trace's size and span, and one row per run with its
        counts, ``hit_rate``, ``shared_traffic`` (per shared tier: blocks read and
        written, and per second of trace time, in blocks and, with ``block_bytes``,
        bytes) and ``sizing`` (the shared tier search, or ``None``).
    """
    seconds = trace_seconds(requests)
    rows = []
    for run in runs:
        result = run.result
        traffic = []
        for (name, read), (_, written) in zip(
            result.shared_hits, result.shared_written, strict=True
        ):
            reads = _per_second(read, seconds, block_bytes)
            writes = _per_second(written, seconds, block_bytes)
            traffic.append(
                {
                    "tier": name,
                    "read_blocks": read,
                    "written_blocks": written,
                    "read_blocks_per_s": reads["blocks_per_s"],
                    "written_blocks_per_s": writes["blocks_per_s"],
                    "read_bytes_per_s": reads["bytes_per_s"],
                    "written_bytes_per_s": writes["bytes_per_s"],
                }
            )
        rows.append(
            {
                **result.as_dict(),
                "shared_traffic": traffic,
                "sizing": run.sizing.as_dict() if run.sizing else None,
            }
        )
    return {
        "trace": trace,
        "requests": len(requests),
        "blocks": sum(len(request.keys) for request in requests),
        "distinct_blocks": len({key for request in requests for key in request.keys}),
        "trace_seconds": seconds,
        "block_bytes": block_bytes,
        "fleets": rows,
    }


def _rate(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    prefix = ""
    for larger in ("K", "M", "G"):
        if value < 1000:
            break
        value, prefix = value / 1000, larger
    return f"{value:.1f} {prefix}{unit}"


def format_fleet_table(summary: dict[str, Any]) -> str:
    """Render a fleet summary as a Markdown table, one row per fleet replay."""
    by_bytes = summary["block_bytes"] is not None
    unit, key = ("B/s", "bytes_per_s") if by_bytes else ("blocks/s", "blocks_per_s")
    sized = any(row["sizing"] for row in summary["fleets"])
    lines = [
        f"trace {summary['trace']}: {summary['requests']} requests over "
        f"{summary['trace_seconds']:.0f} s, {summary['blocks']} blocks requested, "
        f"{summary['distinct_blocks']} distinct",
        "",
        "| engines | routing | host | shared | hit rate | device | host hits | shared hits "
        "| shared read | shared written | busiest engine |"
        + (" shared for target |" if sized else "")
        + " seconds |",
        "|---:|---|---:|---|---:|---:|---:|---|---|---|---:|" + ("---|" if sized else "") + "---:|",
    ]
    for row in summary["fleets"]:
        shared = ", ".join(f"{name}={blocks}" for name, blocks in row["shared_tiers"])
        hits = ", ".join(f"{name} {blocks}" for name, blocks in row["shared_hits"])
        read = ", ".join(_rate(t[f"read_{key}"], unit) for t in row["shared_traffic"])
        written = ", ".join(_rate(t[f"written_{key}"], unit) for t in row["shared_traffic"])
        cells = [
            str(row["engines"]),
            row["routing"],
            str(row["host_blocks"]),
            shared,
            f"{row['hit_rate']:.4f}",
            str(row["device_hits"]),
            str(row["host_hits"]),
            hits,
            read,
            written,
            f"{row['busiest_engine_requests']} of {row['requests']}",
        ]
        sizing = row["sizing"]
        if sized:
            cells.append(
                f"{sizing['tier']}={sizing['capacity_blocks']}: {sizing['hit_rate']:.4f} "
                f"({sizing['target_fraction']:.0%} of {sizing['unbounded_hit_rate']:.4f})"
                if sizing
                else "-"
            )
        cells.append(f"{row['seconds']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_fleet(summary: dict[str, Any], path: str) -> None:
    """Plot a fleet sweep to a PNG file: against the number of engines, one line per routing,
    the hit rate by source, the shared tiers' reads and writes per second, and the shared
    capacity that reaches the target (when it was searched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows = summary["fleets"]
    sized = any(row["sizing"] for row in rows)
    figure, panels = plt.subplots(1, 3 if sized else 2, figsize=(12 if sized else 8.5, 3.6))
    hits, traffic = panels[0], panels[1]
    by_bytes = summary["block_bytes"] is not None
    key, scale = ("bytes_per_s", 1e6) if by_bytes else ("blocks_per_s", 1)
    series: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        label = (
            row["routing"]
            if len({r["host_blocks"] for r in rows}) == 1
            else (f"{row['routing']}, host {row['host_blocks']}")
        )
        series.setdefault(label, []).append(row)
    for number, (label, points) in enumerate(series.items()):
        color = f"C{number % 10}"
        points.sort(key=lambda row: row["engines"])
        engines = [row["engines"] for row in points]
        host = [row["host_hits"] / row["blocks"] for row in points]
        hits.plot(
            engines,
            [row["hit_rate"] for row in points],
            "o-",
            color=color,
            label=f"{label}: host + shared",
        )
        hits.plot(engines, host, "s--", color=color, label=f"{label}: host only")
        reads = [
            sum(t[f"read_{key}"] or 0 for t in row["shared_traffic"]) / scale for row in points
        ]
        writes = [
            sum(t[f"written_{key}"] or 0 for t in row["shared_traffic"]) / scale for row in points
        ]
        traffic.plot(engines, reads, "o-", color=color, label=f"{label}: read")
        traffic.plot(engines, writes, "s--", color=color, label=f"{label}: written")
        if sized:
            panels[2].plot(
                engines,
                [row["sizing"]["capacity_blocks"] for row in points],
                "o-",
                color=color,
                label=label,
            )
    hits.set_ylabel("prefix hit rate")
    traffic.set_ylabel("shared tier " + ("MB" if by_bytes else "blocks") + " per trace second")
    if sized:
        target = next(row["sizing"]["target_fraction"] for row in rows if row["sizing"])
        panels[2].set_ylabel(f"shared blocks for {target:.0%} of unbounded")
        panels[2].set_yscale("log")
        panels[2].yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    sizes = sorted({row["engines"] for row in rows})
    for axes in panels:
        axes.set_xscale("log", base=2)
        axes.set_xticks(sizes, [str(size) for size in sizes])
        axes.set_xlabel("engines")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7)
    figure.suptitle(f"{Path(summary['trace']).name} ({summary['requests']} requests)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
