"""``kvtier simulate``: replay a request trace through the offload manager and compare policies.

Every policy is built through the plugin registry exactly as the offload
manager builds it, and replayed through an :class:`~kvtier.offload.manager.OffloadManager`
at each capacity (see :mod:`kvtier.simulator.replay`); the Belady (farthest next
use) bound is replayed alongside. The result is the prefix hit rate of each
policy at each capacity with the blocks stored, loaded and evicted, as a table,
as JSON (``--json``) or as a plot (``--plot FILE.png``).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError
from tqdm import tqdm

from kvtier.cli import check_output_file
from kvtier.config.sizes import parse_bytes
from kvtier.index.base import BlockIndex
from kvtier.kinds import BLOCK_INDEX
from kvtier.models import PluginConfig
from kvtier.plugins import default_registry
from kvtier.simulator.belady import belady_index
from kvtier.simulator.generate import WORKLOADS, generate_trace
from kvtier.simulator.replay import REPLAY_NAMESPACE, ReplayResult, replay
from kvtier.simulator.report import BELADY, format_table, plot_hit_rates, summarize
from kvtier.simulator.tiers import LowerChain, parse_tiers
from kvtier.simulator.traces import TraceError, TraceRequest, check_trace_file, load_trace

logger = logging.getLogger(__name__)

DEFAULT_CAPACITIES = "500,1000,2000,4000,8000,16000,32000"
SYNTHETIC_PREFIX = "synthetic:"
MAX_CAPACITY_BLOCKS = 1 << 24
"""Largest tier replayed, in blocks: each policy's index keeps about 50 bytes per slot
(about 800 MiB at this size, which is 2 TiB of 128 KiB blocks)."""

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``kvtier simulate``'s arguments to ``parser``."""
    parser.add_argument(
        "trace",
        metavar="TRACE",
        help="JSON Lines trace (Mooncake 'hash_ids' or kvtier 'token_ids' format), or "
        f"'{SYNTHETIC_PREFIX}WORKLOAD' for a generated one ({', '.join(WORKLOADS)})",
    )
    parser.add_argument(
        "--policies",
        help="comma list of registered block indexes to replay (default: all registered); "
        "NAME:KEY=VALUE[:KEY=VALUE...] replays one with settings changed from its defaults, "
        "e.g. prefix_arc:admission=all",
    )
    parser.add_argument(
        "--capacities",
        default=DEFAULT_CAPACITIES,
        help=f"comma list of tier sizes in blocks (default: {DEFAULT_CAPACITIES})",
    )
    parser.add_argument(
        "--tiers",
        help="host tier and tiers below it in blocks, replacing --capacities, e.g. "
        "host=4000,disk=64000; several sizes of a tier joined by '/' (host=2000/4000) are "
        "each replayed; the results say which tier each hit came from",
    )
    parser.add_argument(
        "--capacity-bytes",
        help="comma list of tier sizes in bytes ('8GiB,16GiB'); needs --block-bytes and "
        "replaces --capacities",
    )
    parser.add_argument(
        "--block-bytes", help="bytes per block (one KV block, all layers), for --capacity-bytes"
    )
    parser.add_argument(
        "--device-blocks",
        type=int,
        default=0,
        help="size in blocks of an LRU device prefix cache in front of the tier (default: none)",
    )
    parser.add_argument(
        "--store-mode",
        choices=("eager", "lazy"),
        default="eager",
        help="eager: store every computed block; lazy: store blocks the device cache evicts",
    )
    parser.add_argument(
        "--no-belady", action="store_true", help="skip the Belady (farthest next use) bound"
    )
    parser.add_argument(
        "--format",
        dest="trace_format",
        choices=("auto", "mooncake", "kvtier"),
        default="auto",
        help="trace format (default: decided per line)",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=16,
        help="tokens per block when hashing a kvtier 'token_ids' trace (default: 16)",
    )
    parser.add_argument(
        "--requests", type=int, help="replay only the first N requests of the trace"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of a synthetic trace (default: 0)"
    )
    parser.add_argument(
        "--synthetic-requests",
        type=int,
        default=4000,
        help="requests in a synthetic trace (default: 4000)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.png", help="write hit rate vs capacity to FILE.png")


class UsageError(ValueError):
    """A command-line value is invalid; the message says which and why."""


def _parse_list(text: str, option: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"{option} needs at least one value")
    return items


def _capacities(args: argparse.Namespace) -> list[int]:
    if args.capacity_bytes is None:
        try:
            capacities = [int(c) for c in _parse_list(args.capacities, "--capacities")]
        except ValueError as exc:
            raise UsageError(f"--capacities must be whole numbers of blocks: {exc}") from exc
    else:
        if args.block_bytes is None:
            raise UsageError("--capacity-bytes needs --block-bytes (the size of one block)")
        try:
            block_bytes = parse_bytes(args.block_bytes)
            sizes = [
                parse_bytes(size) for size in _parse_list(args.capacity_bytes, "--capacity-bytes")
            ]
        except ValueError as exc:
            raise UsageError(f"--capacity-bytes/--block-bytes: {exc}") from exc
        if block_bytes <= 0:
            raise UsageError("--block-bytes must be positive")
        capacities = [size // block_bytes for size in sizes]
    if any(capacity <= 0 for capacity in capacities):
        raise UsageError(f"every capacity must hold at least one block, got {capacities}")
    too_large = [capacity for capacity in capacities if capacity > MAX_CAPACITY_BLOCKS]
    if too_large:
        raise UsageError(
            f"capacities {', '.join(map(str, too_large))} exceed the simulator's limit of "
            f"{MAX_CAPACITY_BLOCKS} blocks per tier (each replayed index keeps about 50 bytes "
            "per slot); a tier larger than the trace's blocks hits no more anyway"
        )
    return capacities


def _check_options(args: argparse.Namespace) -> None:
    """Refuse option values the replay would fail on, before the trace is read."""
    for option, value in (
        ("--block-tokens", args.block_tokens),
        ("--synthetic-requests", args.synthetic_requests),
        ("--requests", args.requests),
    ):
        if value is not None and value <= 0:
            raise UsageError(f"{option} must be at least 1, got {value}")
    if args.device_blocks < 0:
        raise UsageError("--device-blocks must not be negative")
    if args.store_mode == "lazy" and args.device_blocks <= 0:
        raise UsageError("--store-mode lazy needs a device cache: give --device-blocks")
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("--plot needs matplotlib; install it with 'pip install matplotlib'")
        try:
            check_output_file(args.plot)
        except ValueError as exc:
            raise UsageError(f"--plot {exc}") from None
        from matplotlib.backend_bases import FigureCanvasBase

        suffix = Path(args.plot).suffix.lstrip(".").lower()
        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix not in formats:
            raise UsageError(
                f"--plot {args.plot}: name the file with one of the suffixes "
                f"{', '.join('.' + name for name in sorted(formats))}"
            )


def _policies(args: argparse.Namespace) -> list[str]:
    registered = default_registry().of_kind(BLOCK_INDEX)
    if args.policies is None:
        return list(registered)
    specs = _parse_list(args.policies, "--policies")
    unknown = [spec for spec in specs if spec.split(":", 1)[0] not in registered]
    if unknown:
        raise UsageError(
            f"no block index named {', '.join(repr(spec.split(':', 1)[0]) for spec in unknown)}; "
            f"registered: {', '.join(sorted(registered))}"
        )
    for spec in specs:
        policy_config(spec)
    return specs


def policy_config(spec: str) -> PluginConfig:
    """The config of a policy spec: ``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE...]``.

    Args:
        spec: A registered block-index name, optionally followed by settings that
            replace the defaults of its config model.

    Returns:
        The validated config.

    Raises:
        UsageError: A setting is malformed or its config model rejects it.
    """
    name, *settings = spec.split(":")
    values = {}
    for setting in settings:
        key, equals, value = setting.partition("=")
        if not equals or not key:
            raise UsageError(f"policy {spec!r}: settings are KEY=VALUE, got {setting!r}")
        values[key] = value
    model = default_registry().get(BLOCK_INDEX, name).config_model
    try:
        return model.model_validate(values)  # type: ignore[no-any-return]
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in exc.errors()
        )
        raise UsageError(f"policy {spec!r}: {problems}") from exc


def _trace(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace.startswith(SYNTHETIC_PREFIX):
        workload = args.trace[len(SYNTHETIC_PREFIX) :]
        if workload not in WORKLOADS:
            raise UsageError(
                f"unknown synthetic workload {workload!r}; choose one of {', '.join(WORKLOADS)}"
            )
        requests = generate_trace(workload, args.synthetic_requests, args.seed)  # type: ignore[arg-type]
    else:
        requests = load_trace(args.trace, args.trace_format, args.block_tokens)
    if args.requests is not None:
        requests = requests[: args.requests]
    return requests


def simulate(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    capacities: Sequence[int],
    *,
    belady: bool = True,
    device_blocks: int = 0,
    store_mode: str = "eager",
    show_progress: bool = False,
    lower_chains: Sequence[LowerChain] = ((),),
) -> list[ReplayResult]:
    """Replay ``requests`` once per policy and capacity (plus the Belady bound).

    Args:
        requests: The trace.
        policies: Registered block-index names, each built from its default config, or
            ``NAME:KEY=VALUE`` specs with settings changed (see :func:`policy_config`).
        capacities: Tier sizes in blocks.
        belady: Whether to replay the Belady bound too (named ``"belady"`` in the results).
        device_blocks: Size of a device prefix cache in front of the tier; 0 for none.
        store_mode: ``"eager"`` or ``"lazy"`` (see :func:`kvtier.simulator.replay.replay`).
        show_progress: Draw a progress bar on stderr.
        lower_chains: Tiers below the host tier to replay each capacity over, one
            chain at a time (see :mod:`kvtier.simulator.tiers`); ``((),)`` for none.

    Returns:
        One result per (capacity, lower chain, policy), capacities in the given order.
    """
    registry = default_registry()
    names = [*policies, *([BELADY] if belady else [])]
    results = []
    with tqdm(
        total=len(requests) * len(names) * len(capacities) * len(lower_chains),
        desc="replay",
        unit="req",
        file=sys.stderr,
        disable=not show_progress,
    ) as bar:
        for capacity, chain in itertools.product(capacities, lower_chains):
            for name in names:
                hook = None
                if name == BELADY:
                    index: BlockIndex
                    index, hook = belady_index(requests, capacity, REPLAY_NAMESPACE)
                else:
                    index = registry.build(BLOCK_INDEX, policy_config(name), capacity)
                result = replay(
                    requests,
                    index,
                    policy_name=name,
                    device_blocks=device_blocks,
                    store_mode=store_mode,  # type: ignore[arg-type]
                    before_request=hook,
                    progress=bar.update,
                    lower_tiers=chain,
                )
                logger.info("%s at %d blocks: hit rate %.4f", name, capacity, result.hit_rate)
                results.append(result)
    return results


def run(args: argparse.Namespace) -> int:
    """Run ``kvtier simulate`` with parsed ``args``; return the exit status."""
    try:
        capacities = _capacities(args)
        lower_chains: list[LowerChain] = [()]
        if args.tiers is not None:
            try:
                capacities, lower_chains = parse_tiers(args.tiers)
            except ValueError as exc:
                raise UsageError(f"--tiers {exc}") from None
        _check_options(args)
        if not args.trace.startswith(SYNTHETIC_PREFIX):
            check_trace_file(args.trace)
        policies = _policies(args)
        requests = _trace(args)
    except (UsageError, TraceError) as exc:
        print(f"kvtier simulate: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"kvtier simulate: no such trace file: {exc.filename}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvtier simulate: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    results = simulate(
        requests,
        policies,
        capacities,
        belady=not args.no_belady,
        device_blocks=args.device_blocks,
        store_mode=args.store_mode,
        show_progress=sys.stderr.isatty(),
        lower_chains=lower_chains,
    )
    summary = summarize(args.trace, requests, results)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(summary))
    if args.plot:
        try:
            plot_hit_rates(summary, args.plot)
        except OSError as exc:
            print(f"kvtier simulate: cannot write {args.plot}: {exc.strerror}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
