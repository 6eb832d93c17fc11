"""Check the GPU copy targets on ``kvtier bench copy`` reports; print the verdicts as JSON.

Reads one report per backend (``kvtier bench copy --backend NAME --output FILE``,
all from the same run on the same machine) and evaluates, from the ratios
each report measured against its contiguous pinned copy:

- ``dma`` >= 90% of the contiguous copy from 256 KiB blocks up (store and load);
- ``kernel`` >= 80% of it at 16-32 KiB blocks, and ahead of ``dma`` there;
- store and load together >= 1.6x the faster single direction (``dma``, from 256 KiB);
- the block size from which ``dma`` beats ``kernel``: the measured value for
  ``auto``'s ``kernel_below_bytes``.

    python benchmarks/gpu_targets.py out/bench-copy-dma.json out/bench-copy-kernel.json

Exit status 0 when every evaluated target is met, 1 when one is missed, 2
when the reports cannot be read or lack the backends a target needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

KiB = 1 << 10


def _by_size(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(row["block_bytes"]): row for row in report["results"]}


def _worst(values: list[float]) -> float | None:
    return min(values) if values else None


def _check(name: str, values: list[float], target: float) -> dict[str, Any]:
    worst = _worst(values)
    return {
        "target": name,
        "threshold": target,
        "worst": None if worst is None else round(worst, 3),
        "met": None if worst is None else worst >= target,
    }


def evaluate(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Evaluate the targets on ``reports`` (backend name -> ``kvtier bench copy`` report)."""
    sizes = {name: _by_size(report) for name, report in reports.items()}

    def rows(name: str, keep: Callable[[int], bool]) -> list[tuple[int, dict[str, Any]]]:
        return sorted((size, row) for size, row in sizes.get(name, {}).items() if keep(size))

    large = lambda size: size >= 256 * KiB  # noqa: E731
    small = lambda size: 16 * KiB <= size <= 32 * KiB  # noqa: E731
    checks: list[dict[str, Any]] = []
    if "dma" in sizes:
        checks.append(
            _check(
                "dma >= 90% of the contiguous copy from 256 KiB",
                [row[mode]["ratio"] for _, row in rows("dma", large) for mode in ("store", "load")],
                0.9,
            )
        )
        checks.append(
            _check(
                "dma: store and load together >= 1.6x a single direction, from 256 KiB",
                [
                    2
                    * row["both"]["gb_per_s"]
                    / max(row["store"]["gb_per_s"], row["load"]["gb_per_s"])
                    for _, row in rows("dma", large)
                ],
                1.6,
            )
        )
    if "kernel" in sizes:
        checks.append(
            _check(
                "kernel >= 80% of the contiguous copy at 16-32 KiB",
                [
                    row[mode]["ratio"]
                    for _, row in rows("kernel", small)
                    for mode in ("store", "load")
                ],
                0.8,
            )
        )
    verdict: dict[str, Any] = {"checks": checks}
    if "kernel" in sizes and "dma" in sizes:
        dma = sizes["dma"]
        checks.append(
            _check(
                "kernel ahead of dma at 16-32 KiB",
                [
                    row[mode]["gb_per_s"] / dma[size][mode]["gb_per_s"]
                    for size, row in rows("kernel", small)
                    if size in dma
                    for mode in ("store", "load")
                ],
                1.0,
            )
        )
        dma_wins = [
            size
            for size, row in rows("kernel", lambda size: size in dma)
            if dma[size]["store"]["gb_per_s"] + dma[size]["load"]["gb_per_s"]
            >= row["store"]["gb_per_s"] + row["load"]["gb_per_s"]
        ]
        verdict["auto_kernel_below_bytes_measured"] = min(dma_wins) if dma_wins else None
    verdict["all_met"] = all(check["met"] is not False for check in checks) and bool(checks)
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="kvtier bench copy JSON reports")
    args = parser.parse_args(argv)
    reports: dict[str, dict[str, Any]] = {}
    for path in args.reports:
        try:
            with open(path, encoding="utf-8") as handle:
                report = json.load(handle)
            reports[str(report["backend"])] = report
        except (OSError, ValueError, KeyError) as exc:
            print(f"gpu_targets: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    verdict = evaluate(reports)
    if not verdict["checks"]:
        print("gpu_targets: no dma or kernel report among the inputs", file=sys.stderr)
        return 2
    json.dump(verdict, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if verdict["all_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
