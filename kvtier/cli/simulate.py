"""``kvtier simulate``: replay a request trace through eviction policies and compare them.

The replay itself is :func:`kvtier.simulator.simulate`. The result is the
prefix hit rate of each policy at each capacity with the blocks stored, loaded
and evicted, as a table, as JSON (``--json``) or as a plot (``--plot
FILE.png``). With ``--trace-state N`` each policy's own counters
(:meth:`~kvtier.index.EvictionPolicy.state`) are sampled every N requests and
written to the JSON and the plot.

With ``--fleet N`` the trace is replayed across N engines, each with its own
host tier, over the tiers below it shared (``--tiers``), routed by
``--routing``; ``--fleet-sweep`` replays 1, 2, 4, ... N engines and
``--shared-target`` searches the shared capacity that reaches a fraction of
an unbounded one's hit rate (:mod:`kvtier.simulator.fleet`).

Policies come from ``--policies`` (``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE...]``,
quoting a value that holds ``,``, ``:`` or ``=``) and ``--policy-file`` (JSON
or YAML); see :mod:`kvtier.simulator.policies`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from kvtier.cli.common import check_output_file
from kvtier.config.units import parse_bytes
from kvtier.kinds import BLOCK_INDEX
from kvtier.plugins import default_registry
from kvtier.simulator import simulate
from kvtier.simulator.fleet import ROUTINGS, Routing, fleet_sizes, simulate_fleet
from kvtier.simulator.generate import WORKLOADS, generate_trace
from kvtier.simulator.policies import (
    PolicyError,
    PolicySpec,
    parse_policy,
    read_policy_file,
    split_unquoted,
)
from kvtier.simulator.report import (
    format_fleet_table,
    format_table,
    plot_fleet,
    plot_hit_rates,
    summarize,
    summarize_fleet,
)
from kvtier.simulator.tiers import LowerChain, parse_tiers
from kvtier.simulator.traces import TraceError, TraceRequest, check_trace_file, load_trace

DEFAULT_CAPACITIES = "500,1000,2000,4000,8000,16000,32000"
SYNTHETIC_PREFIX = "synthetic:"
MAX_FLEET = 1024
"""Most engines a fleet replay builds (each with its own manager and host tier index)."""
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
        help="comma list of registered block indexes to replay (default: all registered, "
        "unless --policy-file names some); NAME:KEY=VALUE[:KEY=VALUE...] replays one with "
        "settings changed from its defaults, e.g. prefix_arc:admission=all; quote a value "
        "holding ',', ':' or '=' (NAME:KEY=\"a,b\")",
    )
    parser.add_argument(
        "--policy-file",
        metavar="FILE",
        help="JSON or YAML file whose 'policies' list names more policies to replay: each a "
        "NAME, or a mapping with 'type' and settings, like the index config section",
    )
    parser.add_argument(
        "--trace-state",
        metavar="N",
        type=int,
        help="record each policy's own counters (list sizes, adaptive targets) every N "
        "requests, into the JSON and the plot",
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
        "--block-bytes",
        help="bytes per block (one KV block, all layers), for --capacity-bytes and a fleet's "
        "shared tier bytes per second",
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
        "--lower-writes",
        choices=("eviction", "store"),
        default="eviction",
        help="with --tiers, when the tiers below the host tier are written: as the host tier "
        "evicts a block (as the offload path does; default) or as soon as it stores one "
        "(write-through; eager stores only)",
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
    parser.add_argument(
        "--fleet",
        metavar="N",
        type=int,
        help="replay the trace across N engines, each with its own host tier (and device "
        "cache), sharing the tiers below it that --tiers names",
    )
    parser.add_argument(
        "--routing",
        default="round_robin",
        help="with --fleet, how requests reach engines, a comma list to compare several: "
        "round_robin (in turn) or prefix_affinity (by a hash of the first block); "
        "default round_robin",
    )
    parser.add_argument(
        "--fleet-sweep",
        action="store_true",
        help="with --fleet N, replay fleets of 1, 2, 4, ... N engines",
    )
    parser.add_argument(
        "--shared-target",
        metavar="FRACTION",
        type=float,
        help="with --fleet, also search the smallest capacity of the last shared tier whose "
        "hit rate reaches FRACTION (e.g. 0.9) of an unbounded one's",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="write hit rate vs capacity (with --fleet: hit rate, shared traffic and sizing vs "
        "engines) to FILE.png",
    )


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
        block_bytes = _block_bytes(args)
        if block_bytes is None:
            raise UsageError("--capacity-bytes needs --block-bytes (the size of one block)")
        try:
            sizes = [
                parse_bytes(size) for size in _parse_list(args.capacity_bytes, "--capacity-bytes")
            ]
        except ValueError as exc:
            raise UsageError(f"--capacity-bytes: {exc}") from exc
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
    if args.trace_state is not None and args.trace_state <= 0:
        raise UsageError(f"--trace-state must be at least 1 request, got {args.trace_state}")
    if args.device_blocks < 0:
        raise UsageError("--device-blocks must not be negative")
    if args.store_mode == "lazy" and args.device_blocks <= 0:
        raise UsageError("--store-mode lazy needs a device cache: give --device-blocks")
    if args.lower_writes == "store" and args.store_mode == "lazy":
        raise UsageError(
            "--lower-writes store writes what the host tier stores as it is computed; "
            "use it with --store-mode eager"
        )
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


def _check_fleet(args: argparse.Namespace, lower_chains: list[LowerChain]) -> list[Routing]:
    """Refuse fleet options given alone or out of range; return the routings to replay."""
    if args.fleet is None:
        for option, given in (
            ("--fleet-sweep", args.fleet_sweep),
            ("--shared-target", args.shared_target is not None),
            ("--routing", args.routing != "round_robin"),
        ):
            if given:
                raise UsageError(f"{option} needs --fleet N (the number of engines)")
        return []
    if not 1 <= args.fleet <= MAX_FLEET:
        raise UsageError(f"--fleet must be from 1 to {MAX_FLEET} engines, got {args.fleet}")
    if not all(lower_chains):
        raise UsageError(
            "--fleet needs the shared tiers below the host tier: give --tiers, e.g. "
            "host=4000,redis=64000"
        )
    if args.trace_state is not None:
        raise UsageError("--trace-state is not recorded in a fleet replay; drop it or --fleet")
    if args.shared_target is not None and not 0 < args.shared_target <= 1:
        raise UsageError(
            f"--shared-target is a fraction of the unbounded hit rate in (0, 1], "
            f"got {args.shared_target}"
        )
    routings = _parse_list(args.routing, "--routing")
    unknown = [routing for routing in routings if routing not in ROUTINGS]
    if unknown:
        raise UsageError(
            f"--routing {', '.join(map(repr, unknown))}: choose {' or '.join(ROUTINGS)}"
        )
    return routings  # type: ignore[return-value]


def _block_bytes(args: argparse.Namespace) -> int | None:
    if args.block_bytes is None:
        return None
    try:
        block_bytes = parse_bytes(args.block_bytes)
    except ValueError as exc:
        raise UsageError(f"--block-bytes: {exc}") from exc
    if block_bytes <= 0:
        raise UsageError("--block-bytes must be positive")
    return block_bytes


def _policies(args: argparse.Namespace) -> list[PolicySpec]:
    specs = []
    if args.policies is not None:
        entries = [entry.strip() for entry in split_unquoted(args.policies, ",", "--policies")]
        if not any(entries):
            raise UsageError("--policies needs at least one value")
        specs = [parse_policy(entry) for entry in entries if entry]
    if args.policy_file is not None:
        specs += read_policy_file(args.policy_file)
    if not specs:
        specs = [parse_policy(name) for name in default_registry().of_kind(BLOCK_INDEX)]
    return specs


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
        routings = _check_fleet(args, lower_chains)
        block_bytes = _block_bytes(args)
        if not args.trace.startswith(SYNTHETIC_PREFIX):
            check_trace_file(args.trace)
        policies = _policies(args)
        if args.fleet is not None and len(policies) != 1:
            if args.policies is not None or args.policy_file is not None:
                raise UsageError(
                    f"--fleet replays one host tier policy; {len(policies)} were given "
                    f"({', '.join(spec.label for spec in policies)})"
                )
            policies = [parse_policy(BLOCK_INDEX.default)]
        requests = _trace(args)
    except (UsageError, PolicyError, TraceError) as exc:
        print(f"kvtier simulate: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"kvtier simulate: no such trace file: {exc.filename}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvtier simulate: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    if args.fleet is not None:
        runs = simulate_fleet(
            requests,
            policies[0],
            capacities,
            lower_chains,
            fleet_sizes(args.fleet) if args.fleet_sweep else [args.fleet],
            routings,
            device_blocks=args.device_blocks,
            store_mode=args.store_mode,
            lower_writes=args.lower_writes,
            target_fraction=args.shared_target,
            show_progress=sys.stderr.isatty(),
        )
        summary = summarize_fleet(args.trace, requests, runs, block_bytes)
        table, plot = format_fleet_table, plot_fleet
    else:
        results = simulate(
            requests,
            policies,
            capacities,
            belady=not args.no_belady,
            device_blocks=args.device_blocks,
            store_mode=args.store_mode,
            show_progress=sys.stderr.isatty(),
            lower_chains=lower_chains,
            lower_writes=args.lower_writes,
            state_every=args.trace_state or 0,
        )
        summary = summarize(args.trace, requests, results)
        table, plot = format_table, plot_hit_rates
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(table(summary))
    if args.plot:
        try:
            plot(summary, args.plot)
        except OSError as exc:
            print(f"kvtier simulate: cannot write {args.plot}: {exc.strerror}", file=sys.stderr)
            return 1
        print(f"kvtier simulate: plot written to {args.plot}", file=sys.stderr)
    return 0
