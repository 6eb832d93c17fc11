"""Policy sweep: each policy's hit rate relative to ``lru``, over several traces and capacities.

Replays every trace (a Mooncake or kvtier JSON Lines file, or
``synthetic:WORKLOAD:SEED``) at every capacity through ``lru`` and the named
policies, built through the plugin registry as ``kvtier simulate`` builds them
(``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE...]``), with no device cache and eager
stores. Prints JSON: the constants set, one row per trace, policy and capacity
(hit rate, ratio to ``lru``, seconds) and one summary per policy (the smallest
ratio, the geometric mean and the cells below ``lru``). ``--table`` prints a
Markdown table instead, one row per trace and policy, one column per capacity.
Each row is also logged to stderr as it is measured, so a long sweep shows progress.

``--set MODULE.NAME=VALUE`` replaces a module constant (an int or a float)
before the replays, to measure a policy's sensitivity to it, for example
``--set kvtier.index.prefix_arc.DUEL_LIMIT=128``.

Usage::

    python benchmarks/policy_sweep.py --policies arc,prefix_arc \\
        --traces mooncake_synthetic_trace.jsonl,synthetic:chat:0
    python benchmarks/policy_sweep.py --policies prefix_arc --seeds 0,1,2,3,4 \\
        --plot ratios.png > sweep.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.simulator import simulate
from kvtier.simulator.generate import WORKLOADS, generate_trace
from kvtier.simulator.report import BASELINE
from kvtier.simulator.traces import TraceRequest, load_trace

DEFAULT_CAPACITIES = "500,1000,2000,4000,8000,16000,32000,65536,131072"
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
DEFAULT_MOONCAKE = DEFAULT_TRACE / "mooncake_synthetic_trace.jsonl"


def trace_names(traces: str | None, seeds: Sequence[int]) -> list[str]:
    """The traces to replay: ``traces`` as given, else the Mooncake trace and every workload."""
    if traces:
        return [name.strip() for name in traces.split(",") if name.strip()]
    names = [str(DEFAULT_MOONCAKE)]
    names += [f"synthetic:{workload}:{seed}" for workload in WORKLOADS for seed in seeds]
    return names


def load(name: str, synthetic_requests: int) -> list[TraceRequest]:
    """A trace file, or ``synthetic:WORKLOAD:SEED`` generated with ``synthetic_requests``."""
    if not name.startswith("synthetic:"):
        return load_trace(name)
    _, workload, seed = name.split(":")
    if workload not in WORKLOADS:
        raise SystemExit(
            f"unknown workload {workload!r} in {name!r}; choose {', '.join(WORKLOADS)}"
        )
    return generate_trace(workload, synthetic_requests, int(seed))  # type: ignore[arg-type]


def set_constant(assignment: str) -> None:
    """Apply ``MODULE.NAME=VALUE`` to a module constant of the same type."""
    target, equals, value = assignment.partition("=")
    module_name, _, constant = target.rpartition(".")
    if not equals or not module_name:
        raise SystemExit(f"--set takes MODULE.NAME=VALUE, got {assignment!r}")
    module = importlib.import_module(module_name)
    current = getattr(module, constant, None)
    if not isinstance(current, (int, float)) or isinstance(current, bool):
        raise SystemExit(f"--set: {target} is not a numeric module constant")
    setattr(module, constant, type(current)(value))


def sweep(
    traces: Sequence[str], policies: Sequence[str], capacities: Sequence[int], requests: int
) -> list[dict[str, Any]]:
    """Replay each trace through ``lru`` and ``policies``; one row per trace, policy, capacity."""
    rows = []
    for name in traces:
        trace = load(name, requests)
        for capacity in capacities:
            results = simulate(trace, [BASELINE, *policies], [capacity], belady=False)
            lru = results[0].hit_rate
            for result in results:
                row = {
                    "trace": name,
                    "policy": result.policy,
                    "capacity_blocks": capacity,
                    "hit_rate": result.hit_rate,
                    "vs_lru": result.hit_rate / lru if lru else None,
                    "seconds": result.seconds,
                }
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, Any]], capacities: Sequence[int]) -> str:
    """Markdown: one row per trace and policy (``lru`` left out), one column per capacity."""
    cells: dict[tuple[str, str], dict[int, float | None]] = {}
    for row in rows:
        if row["policy"] != BASELINE:
            cells.setdefault((row["trace"], row["policy"]), {})[row["capacity_blocks"]] = row[
                "vs_lru"
            ]
    header = "| trace | policy | " + " | ".join(f"{c:,}" for c in capacities) + " |"
    lines = [header, "|---|---|" + "---:|" * len(capacities)]
    for (trace, policy), ratios in cells.items():
        values = " | ".join(_ratio(ratios.get(capacity)) for capacity in capacities)
        lines.append(f"| {Path(trace).name} | {policy} | {values} |")
    lines += ["", "| policy | smallest | geometric mean | cells below lru | cells |"]
    lines.append("|---|---:|---:|---:|---:|")
    for policy, summary in summarize(rows).items():
        lines.append(
            f"| {policy} | {summary['smallest']:.3f} | {summary['geometric_mean']:.3f} "
            f"| {summary['below_lru']} | {summary['cells']} |"
        )
    return "\n".join(lines)


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy: smallest ratio to ``lru``, geometric mean, cells below ``lru``, cells."""
    ratios: dict[str, list[float]] = {}
    for row in rows:
        if row["policy"] != BASELINE and row["vs_lru"] is not None:
            ratios.setdefault(row["policy"], []).append(row["vs_lru"])
    return {
        policy: {
            "smallest": min(values),
            "geometric_mean": math.exp(sum(math.log(v) for v in values) / len(values)),
            "below_lru": sum(v < 1.0 for v in values),
            "cells": len(values),
        }
        for policy, values in ratios.items()
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def workload_of(trace: str) -> str:
    """``synthetic:chat:3`` -> ``chat``; a trace file -> its stem."""
    return trace.split(":")[1] if trace.startswith("synthetic:") else Path(trace).stem


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Plot each policy's ratio to ``lru`` against capacity, one panel per workload.

    Each line is one trace (a seed of a generated workload) and one policy.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(workload_of(r["trace"]) for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != BASELINE))
    figure, axes_list = plt.subplots(
        1, len(workloads), figsize=(4.2 * len(workloads), 3.8), dpi=100, squeeze=False
    )
    for axes, workload in zip(axes_list[0], workloads, strict=True):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for row in rows:
            if (
                row["policy"] != BASELINE
                and row["vs_lru"] is not None
                and workload_of(row["trace"]) == workload
            ):
                key = (row["policy"], row["trace"])
                series.setdefault(key, []).append((row["capacity_blocks"], row["vs_lru"]))
        for (policy, trace), points in series.items():
            points.sort()
            label = policy if trace == next(t for p, t in series if p == policy) else None
            capacities, ratios = zip(*points, strict=True)
            axes.plot(
                capacities,
                ratios,
                marker="o",
                markersize=3,
                linewidth=1,
                color=f"C{policies.index(policy)}",
                label=label,
            )
        axes.axhline(1.0, color="black", linewidth=0.8)
        axes.set_xscale("log")
        axes.set_xlabel("tier capacity (blocks)")
        axes.set_ylabel("hit rate / lru")
        traces = len({trace for _, trace in series})
        axes.set_title(f"{workload} ({traces} trace{'s' if traces != 1 else ''})", fontsize=10)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and print JSON (or a Markdown table), and write a plot if asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="prefix_arc", help="comma list of policy specs")
    parser.add_argument("--capacities", default=DEFAULT_CAPACITIES, help="comma list, blocks")
    parser.add_argument(
        "--traces",
        help="comma list of trace files and synthetic:WORKLOAD:SEED "
        "(default: the Mooncake trace and every workload at --seeds)",
    )
    parser.add_argument("--seeds", default="0,1,2,3,4", help="seeds of the default workloads")
    parser.add_argument(
        "--synthetic-requests", type=int, default=4000, help="requests per generated trace"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="MODULE.NAME=VALUE", dest="constants"
    )
    parser.add_argument(
        "--table", action="store_true", help="print a Markdown table instead of JSON"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="also plot the ratios to FILE.png")
    parser.add_argument(
        "--from",
        dest="saved",
        nargs="+",
        metavar="FILE",
        help="replay nothing: merge the rows of earlier runs' JSON output and report those",
    )
    args = parser.parse_args(argv)
    for assignment in args.constants:
        set_constant(assignment)
    if args.saved:
        rows = [row for saved in args.saved for row in json.loads(Path(saved).read_text())["rows"]]
        capacities = sorted({row["capacity_blocks"] for row in rows})
    else:
        capacities = [int(c) for c in args.capacities.split(",")]
        seeds = [int(s) for s in args.seeds.split(",")]
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        traces = trace_names(args.traces, seeds)
        rows = sweep(traces, policies, capacities, args.synthetic_requests)
    if args.table:
        print(format_table(rows, capacities))
    else:
        report = {"constants": args.constants, "rows": rows, "summary": summarize(rows)}
        print(json.dumps(report, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
