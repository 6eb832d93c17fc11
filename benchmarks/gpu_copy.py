"""GPU copy benchmark: each backend against a contiguous pinned copy of the same bytes.

For every block size, a batch of scattered blocks (no two adjacent, so no
segment merges) is stored to and loaded from a pinned host buffer by each
backend, and both directions run together; the peer is one contiguous
``copy_`` of the same number of bytes between the same device and pinned host
memory, measured in the same run. Results are ratios against that peer, and
the project's targets are checked at the end. Prints one JSON document.

    python benchmarks/gpu_copy.py --backends dma kernel auto > gpu_copy.json

``--device cpu --backends torch`` runs the same measurements on the CPU (a
smoke test of the script itself; the targets are then not evaluated).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvtier.copy.base import CopyBackend, CopyBatch, Direction
from kvtier.layout.base import BlockRegion, KVLayout
from kvtier.plugins import default_registry
from kvtier.tiers.pinning import pin_host_buffer

KiB = 1 << 10
MiB = 1 << 20
DEFAULT_BLOCK_BYTES = [4 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, MiB, 4 * MiB]

logger = logging.getLogger("gpu_copy")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    run()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure_size(
    block_bytes: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    count = max(1, args.batch_bytes // block_bytes)
    nbytes = count * block_bytes
    # 2 * count device blocks, of which every other one is used: nothing merges
    blocks = torch.zeros(2 * count, block_bytes, dtype=torch.uint8, device=device)
    layout = KVLayout((BlockRegion("blocks", blocks),), "bench")
    host = torch.zeros(2 * count, block_bytes, dtype=torch.uint8)
    pinned = pin_host_buffer(host) if device.type == "cuda" else None
    if device.type == "cuda" and pinned is None:
        raise SystemExit("pinning the host buffer failed; see the warning above")
    generator = torch.Generator().manual_seed(block_bytes)
    store_blocks = list(range(0, 2 * count, 2))
    load_blocks = list(range(1, 2 * count, 2))
    store_slots = torch.randperm(count, generator=generator).mul_(2).tolist()
    load_slots = [slot + 1 for slot in store_slots]

    contiguous_device = blocks.view(-1)[:nbytes]
    contiguous_host = host.view(-1)[:nbytes]
    result: dict[str, Any] = {"block_bytes": block_bytes, "blocks": count, "batch_bytes": nbytes}
    d2h = _median_seconds(
        lambda: contiguous_host.copy_(contiguous_device, non_blocking=True), device, args.repeats
    )
    h2d = _median_seconds(
        lambda: contiguous_device.copy_(contiguous_host, non_blocking=True), device, args.repeats
    )
    result["contiguous"] = {"store_GBps": nbytes / d2h / 1e9, "load_GBps": nbytes / h2d / 1e9}

    registry = default_registry()
    for name in args.backends:
        registration = registry.get("copy_backends", name)
        backend: CopyBackend = registration.factory(registration.config_model(), layout, host)
        store = CopyBatch(Direction.STORE, store_blocks, store_slots)
        load = CopyBatch(Direction.LOAD, load_blocks, load_slots)

        def run(*batches: CopyBatch, backend: CopyBackend = backend) -> Callable[[], None]:
            def submit_and_wait() -> None:
                handles = [backend.submit(batch) for batch in batches]
                for handle in handles:
                    backend.wait(handle)

            return submit_and_wait

        try:
            store_s = _median_seconds(run(store), device, args.repeats)
            load_s = _median_seconds(run(load), device, args.repeats)
            both_s = _median_seconds(run(store, load), device, args.repeats)
        finally:
            backend.close()
        single_GBps = max(nbytes / store_s, nbytes / load_s) / 1e9
        result[name] = {
            "store_GBps": nbytes / store_s / 1e9,
            "load_GBps": nbytes / load_s / 1e9,
            "both_GBps": 2 * nbytes / both_s / 1e9,
            "store_vs_contiguous": d2h / store_s,
            "load_vs_contiguous": h2d / load_s,
            "both_vs_single": 2 * nbytes / both_s / 1e9 / single_GBps,
        }
        logger.info("%8d B blocks  %-7s %s", block_bytes, name, result[name])
    if pinned is not None:
        pinned.close()
    return result


def _targets(results: list[dict[str, Any]], backends: list[str]) -> dict[str, Any]:
    """Check the project's GPU targets on the measured ratios (``None``: not measured)."""

    def worst(name: str, sizes: Callable[[int], bool], key: str) -> float | None:
        values = [
            min(r[name][f"store_{key}"], r[name][f"load_{key}"])
            for r in results
            if name in r and sizes(r["block_bytes"])
        ]
        return min(values) if values else None

    checks: dict[str, Any] = {}
    if "dma" in backends:
        ratio = worst("dma", lambda b: b >= 256 * KiB, "vs_contiguous")
        checks["dma_vs_contiguous_from_256KiB"] = {"worst": ratio, "target": 0.9}
        both = [
            r["dma"]["both_vs_single"]
            for r in results
            if "dma" in r and r["block_bytes"] >= 256 * KiB
        ]
        checks["dma_both_vs_single_from_256KiB"] = {
            "worst": min(both) if both else None,
            "target": 1.6,
        }
    if "kernel" in backends:
        small = lambda b: 16 * KiB <= b <= 32 * KiB  # noqa: E731
        ratio = worst("kernel", small, "vs_contiguous")
        checks["kernel_vs_contiguous_16_32KiB"] = {"worst": ratio, "target": 0.8}
        if "dma" in backends:
            ahead = [
                min(
                    r["kernel"]["store_GBps"] / r["dma"]["store_GBps"],
                    r["kernel"]["load_GBps"] / r["dma"]["load_GBps"],
                )
                for r in results
                if small(r["block_bytes"])
            ]
            checks["kernel_vs_dma_16_32KiB"] = {
                "worst": min(ahead) if ahead else None,
                "target": 1.0,
            }
            crossover = [
                r["block_bytes"]
                for r in results
                if r["dma"]["store_GBps"] + r["dma"]["load_GBps"]
                >= r["kernel"]["store_GBps"] + r["kernel"]["load_GBps"]
            ]
            checks["auto_kernel_below_bytes_measured"] = min(crossover) if crossover else None
    for check in checks.values():
        if isinstance(check, dict):
            check["met"] = None if check["worst"] is None else check["worst"] >= check["target"]
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["dma", "kernel", "auto"])
    parser.add_argument("--block-bytes", nargs="+", type=int, default=DEFAULT_BLOCK_BYTES)
    parser.add_argument("--batch-bytes", type=int, default=256 * MiB, help="bytes per batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke test")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    results = [_measure_size(size, args, device) for size in args.block_bytes]
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "batch_bytes": args.batch_bytes,
        "repeats": args.repeats,
        "results": results,
    }
    if device.type == "cuda":
        report["targets"] = _targets(results, args.backends)
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
