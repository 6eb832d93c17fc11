"""``kvtier bench copy``: copy-backend bandwidth against a contiguous copy of the same bytes.

For each block size, the benchmark builds an engine layout of ``--regions``
regions per block and a host buffer, each holding two pools of blocks, and
times three things with the chosen backend:

- ``store``: a batch of blocks from the first engine pool to the first host pool;
- ``load``: a batch from the second host pool to the second engine pool;
- ``both``: the two batches submitted together, then both waited for.

Each is compared with its peer measured in the same run, interleaved with it:
one contiguous copy of the same number of bytes, device to host, host to
device, or both at once (on two streams on CUDA; one after the other on CPU,
where the torch backend also copies in the caller's thread). The host buffer
is a :class:`~kvtier.tiers.host.HostTier`, pinned on CUDA as in serving.

Results come out as a table, or as JSON with ``--json`` (and in the file
``--output`` names), per direction: GB/s of the backend and of the contiguous
copy (best of ``--repeats``, which filters out other processes' interference)
and their ratio, plus the ratio of the medians. A progress bar is drawn on
standard error when it is a terminal.

``--pattern`` sets the block ids: ``permutation`` pairs a random permutation
of one pool's blocks with a random permutation of the other pool's slots;
``scattered`` draws both from the whole pools at random, so neither side has
runs to exploit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from kvtier.cli.common import check_output_file, format_table
from kvtier.config.units import format_bytes, human_bytes, parse_bytes
from kvtier.copy.base import CopyBackend, CopyBatch, Direction
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import KVLayout
from kvtier.layout.resolvers import PerLayerResolver
from kvtier.plugins import PluginError, default_registry
from kvtier.tiers.host import HostTier

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_BYTES = ("4KiB", "16KiB", "64KiB", "256KiB", "1MiB", "2MiB")
"""Block sizes measured when ``--block-bytes`` is not given."""

MODES = ("store", "load", "both")


def _size(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from exc
    if not isinstance(value, int) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of bytes")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser``."""
    parser.add_argument(
        "--backend", default="torch", help="registered copy backend to measure (default: torch)"
    )
    parser.add_argument(
        "--block-bytes",
        nargs="+",
        type=_size,
        default=[_size(size) for size in DEFAULT_BLOCK_BYTES],
        metavar="SIZE",
        help="bytes per block (a record across all regions), e.g. 4KiB 64KiB 2MiB "
        f"(default: {' '.join(DEFAULT_BLOCK_BYTES)})",
    )
    parser.add_argument(
        "--regions",
        type=int,
        default=1,
        help="regions each block is split over, like K and V or layers (default: 1)",
    )
    parser.add_argument(
        "--total-bytes",
        type=_size,
        default=_size("256MiB"),
        metavar="SIZE",
        help="bytes each direction moves per measurement (default: 256MiB)",
    )
    parser.add_argument(
        "--pattern",
        choices=("permutation", "scattered"),
        default="permutation",
        help="block ids: permutations of a pool, or scattered over both pools",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device of the engine blocks (default: cuda if available, else cpu)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random block ids")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--output",
        metavar="FILE",
        help="also write the JSON report to FILE (default: none)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar (drawn only when stderr is a terminal)",
    )


@dataclass
class _Rig:
    """Engine pools, host pools and batches for one block size."""

    layout: KVLayout
    engine: torch.Tensor
    tier: HostTier
    store: CopyBatch
    load: CopyBatch
    blocks: int

    @property
    def host(self) -> torch.Tensor:
        return self.tier.buffer


def _build_rig(args: argparse.Namespace, block_bytes: int) -> _Rig:
    if block_bytes % args.regions:
        raise ValueError(f"{block_bytes}-byte blocks do not split into {args.regions} regions")
    blocks = max(1, args.total_bytes // block_bytes)
    device = torch.device(args.device)
    region_bytes = block_bytes // args.regions
    engine = torch.randint(
        0, 256, (args.regions, 2 * blocks, region_bytes), dtype=torch.uint8, device=device
    )
    layout = PerLayerResolver("block_first").resolve(
        {f"region{index}": engine[index] for index in range(args.regions)}
    )
    tier = HostTier(2 * blocks, block_bytes, pin=device.type == "cuda")
    host = tier.buffer
    host.zero_()  # fault every page in before timing
    generator = torch.Generator().manual_seed(args.seed + block_bytes)
    if args.pattern == "permutation":
        ids = [torch.randperm(blocks, generator=generator) for _ in range(4)]
        engine_ids = (ids[0], ids[1] + blocks)
        host_ids = (ids[2], ids[3] + blocks)
    else:
        engine_all = torch.randperm(2 * blocks, generator=generator)
        host_all = torch.randperm(2 * blocks, generator=generator)
        engine_ids = (engine_all[:blocks], engine_all[blocks:])
        host_ids = (host_all[:blocks], host_all[blocks:])
    store = CopyBatch(Direction.STORE, engine_ids[0].tolist(), host_ids[0].tolist())
    load = CopyBatch(Direction.LOAD, engine_ids[1].tolist(), host_ids[1].tolist())
    return _Rig(layout, engine, tier, store, load, blocks)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, action: Callable[[], None]) -> float:
    _synchronize(device)
    start = time.perf_counter()
    action()
    _synchronize(device)
    return time.perf_counter() - start


def _backend_action(backend: CopyBackend, batches: list[CopyBatch]) -> Callable[[], None]:
    def action() -> None:
        handles = [backend.submit(batch) for batch in batches]
        for handle in handles:
            backend.wait(handle)

    return action


def _contiguous_action(rig: _Rig, mode: str) -> Callable[[], None]:
    """One contiguous copy of the bytes ``mode`` moves (two at once for ``both``)."""
    nbytes = rig.blocks * rig.host.shape[1]
    engine = rig.engine.view(-1)
    host = rig.host.view(-1)
    store = (host[:nbytes], engine[:nbytes])
    load = (engine[nbytes : 2 * nbytes], host[nbytes : 2 * nbytes])
    pairs = {"store": [store], "load": [load], "both": [store, load]}[mode]
    device = rig.engine.device
    if device.type != "cuda" or len(pairs) == 1:

        def copy() -> None:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

        return copy
    streams = [torch.cuda.Stream(device) for _ in pairs]

    def copy_on_streams() -> None:
        current = torch.cuda.current_stream(device)
        for stream, (dst, src) in zip(streams, pairs, strict=True):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)

    return copy_on_streams


def _check(rig: _Rig, batch: CopyBatch) -> None:
    """Spot-check the first and last pair of a batch after it ran."""
    for index in (0, len(batch) - 1):
        block, slot = batch.device_blocks[index], batch.host_slots[index]
        record = torch.cat([region.view[block].cpu() for region in rig.layout.regions])
        if not torch.equal(record, rig.host[slot]):
            raise RuntimeError(
                f"{batch.direction.value} of block {block} <-> slot {slot} produced wrong bytes"
            )


def _significant(value: float) -> float:
    return float(f"{value:.4g}")


def _measure(
    args: argparse.Namespace, block_bytes: int, backend_name: str, progress: tqdm
) -> dict[str, object]:
    rig = _build_rig(args, block_bytes)
    logger.debug(
        "%s: %d blocks of %d bytes in %d regions on %s",
        backend_name,
        rig.blocks,
        block_bytes,
        args.regions,
        rig.engine.device,
    )
    registry = default_registry()
    config = registry.get(COPY_BACKEND, backend_name).config_model.model_validate(
        {"type": backend_name}
    )
    backend: CopyBackend = registry.build(COPY_BACKEND, config, rig.layout, rig.host)
    device = rig.engine.device
    nbytes = rig.blocks * block_bytes
    result: dict[str, object] = {"block_bytes": block_bytes, "blocks": rig.blocks}
    try:
        for mode in MODES:
            batches = {"store": [rig.store], "load": [rig.load], "both": [rig.store, rig.load]}[
                mode
            ]
            run_backend = _backend_action(backend, batches)
            run_contiguous = _contiguous_action(rig, mode)
            run_backend()
            for batch in batches:
                _check(rig, batch)
            run_contiguous()
            backend_s, contiguous_s = [], []
            for _ in range(args.repeats):
                backend_s.append(_timed(device, run_backend))
                contiguous_s.append(_timed(device, run_contiguous))
                progress.update(1)
            backend_best, contiguous_best = min(backend_s), min(contiguous_s)
            result[mode] = {
                "gb_per_s": _significant(nbytes / backend_best / 1e9),
                "contiguous_gb_per_s": _significant(nbytes / contiguous_best / 1e9),
                "ratio": round(contiguous_best / backend_best, 3),
                "ratio_median": round(
                    statistics.median(contiguous_s) / statistics.median(backend_s), 3
                ),
            }
    finally:
        backend.close()
        rig.tier.close()
    return result


class _UsageError(ValueError):
    """An option value the benchmark cannot run with; the message says which and why."""


def _device(text: str) -> torch.device:
    """The ``--device`` value, checked to be a CPU or a CUDA device present here."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise _UsageError(f"--device {text!r} is not a device; use cpu or cuda[:N]") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise _UsageError(f"--device {text}: the benchmark runs on cpu or cuda[:N] only")
    if not torch.cuda.is_available():
        raise _UsageError(
            f"--device {text}: CUDA is not available to torch {torch.__version__} here; "
            "use --device cpu"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise _UsageError(f"--device {text}: this machine has CUDA devices 0 to {count - 1}")
    return device


def _check_memory(args: argparse.Namespace, device: torch.device) -> None:
    """Refuse sizes whose pools cannot fit in this machine's memory, before allocating any."""
    # Each side holds two pools of max(1, total // block) blocks (see _build_rig).
    pools = max(2 * max(1, args.total_bytes // size) * size for size in args.block_bytes)
    host_needed = 2 * pools if device.type == "cpu" else pools
    host_memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limits = [("host memory", host_needed, host_memory)]
    if device.type == "cuda":
        device_memory = torch.cuda.get_device_properties(device).total_memory
        limits.append((f"{device} memory", pools, device_memory))
    for what, needed, available in limits:
        if needed > available:
            raise _UsageError(
                f"--total-bytes {human_bytes(args.total_bytes)} with --block-bytes up to "
                f"{human_bytes(max(args.block_bytes))} needs {human_bytes(needed)} of {what} for "
                f"its block pools, and this machine has {human_bytes(available)}; lower "
                "--total-bytes or --block-bytes"
            )


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse option values the run would fail on, before anything is allocated."""
    if args.regions <= 0 or args.repeats <= 0:
        raise _UsageError("--regions and --repeats must be positive")
    bad = [size for size in args.block_bytes if size % args.regions]
    if bad:
        raise _UsageError(f"block sizes {bad} do not split into {args.regions} regions")
    device = _device(args.device)
    registry = default_registry()
    try:
        registry.get(COPY_BACKEND, args.backend)
    except PluginError as exc:
        raise _UsageError(f"--backend: {exc}") from None
    if args.output is not None:
        try:
            check_output_file(args.output)
        except ValueError as exc:
            raise _UsageError(f"--output {exc}") from None
    _check_memory(args, device)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` and write its JSON report.

    Returns:
        0 on success, 1 if the backend could not be built, produced wrong bytes
        or the report could not be written, 2 for invalid arguments (found
        before anything is allocated).
    """
    try:
        _check_arguments(args)
    except _UsageError as exc:
        print(f"kvtier bench copy: {exc}", file=sys.stderr)
        return 2
    report: dict[str, object] = {
        "benchmark": "copy",
        "backend": args.backend,
        "device": str(torch.device(args.device)),
        "pattern": args.pattern,
        "regions": args.regions,
        "bytes_per_direction": args.total_bytes,
        "repeats": args.repeats,
        "statistic": "best of repeats; ratio_median compares medians",
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
    }
    results: list[dict[str, Any]] = []
    total = len(args.block_bytes) * len(MODES) * args.repeats
    quiet = args.quiet or not sys.stderr.isatty()
    with tqdm(total=total, desc="bench copy", file=sys.stderr, disable=quiet) as progress:
        for block_bytes in args.block_bytes:
            progress.set_postfix_str(f"{block_bytes} B/block")
            try:
                results.append(_measure(args, block_bytes, args.backend, progress))
            except (PluginError, RuntimeError, ValueError) as exc:
                print(f"kvtier bench copy: {exc}", file=sys.stderr)
                return 1
    report["results"] = results
    text = json.dumps(report, indent=2)
    print(text if args.json else _table(args, results))
    if args.output is None:
        return 0
    try:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    except OSError as exc:
        print(f"kvtier bench copy: cannot write {args.output}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


def _table(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    """The results as a heading line and one row per block size and direction."""
    heading = (
        f"{args.backend} on {torch.device(args.device)}, {args.pattern} blocks, {args.regions} "
        f"region(s) per block, {format_bytes(args.total_bytes)} per direction, best of "
        f"{args.repeats}; RATIO is the backend's GB/s over the contiguous copy's"
    )
    rows = [["BLOCK", "BLOCKS", "MODE", "GB/S", "CONTIGUOUS GB/S", "RATIO", "RATIO OF MEDIANS"]]
    for result in results:
        for mode in MODES:
            measured = result[mode]
            rows.append(
                [
                    format_bytes(result["block_bytes"]),
                    str(result["blocks"]),
                    mode,
                    str(measured["gb_per_s"]),
                    str(measured["contiguous_gb_per_s"]),
                    str(measured["ratio"]),
                    str(measured["ratio_median"]),
                ]
            )
    return f"{heading}\n{format_table(rows)}"
