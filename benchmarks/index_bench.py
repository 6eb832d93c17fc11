"""Block-index benchmark: lookups, reserves and commits per second, per registered index.

Runs every registered block index (or those named with ``--index``) through
the same workload and prints one JSON object: per index, keys per second for
``lookup`` (a hit chain), ``reserve`` and ``commit`` (in a full tier, so every
reserve evicts), ``pin``/``unpin``, and the time of one longest-prefix lookup
of an 8,192-block chain; plus each index's cost per key relative to ``lru``
measured in the same run (``cost_vs_lru``: 1.0 is as fast as LRU, 2.0 twice
as slow).

Usage::

    python benchmarks/index_bench.py                 # every registered index
    python benchmarks/index_bench.py --index lru --index arc --slots 65536
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

from kvtier.index.base import BlockIndex, BlockKey
from kvtier.keys import KeyNamespace, hash_token_blocks
from kvtier.kinds import BLOCK_INDEX
from kvtier.plugins import default_registry

LONG_CHAIN_BLOCKS = 8192
LOOKUP_TARGET_KEYS_PER_S = 1_000_000
LONG_CHAIN_TARGET_S = 5e-3


def build_index(name: str, num_slots: int) -> BlockIndex:
    """Build the registered index ``name`` from its default config."""
    registration = default_registry().get(BLOCK_INDEX, name)
    return registration.factory(registration.config_model(), num_slots)


def make_chains(count: int, length: int, seed: int) -> list[list[BlockKey]]:
    """``count`` chains of ``length`` namespaced keys, as an engine integration produces them."""
    namespace = KeyNamespace(model="bench")
    block_tokens = 16
    chains = []
    for chain in range(count):
        tokens = [
            (seed * 1_000_003 + chain * 7919 + i) % 50_000 for i in range(length * block_tokens)
        ]
        chains.append(namespace.keys(hash_token_blocks(tokens, block_tokens), group=0))
    return chains


def fill(index: BlockIndex, chains: list[list[BlockKey]]) -> None:
    """Store every chain (reserve then commit) so its keys are readable."""
    for chain in chains:
        slots = index.reserve(chain)
        index.commit([key for key, slot in zip(chain, slots, strict=True) if slot is not None])
    index.take_events()


def best_rate(run: Callable[[], int], repeats: int) -> float:
    """Keys per second of the fastest of ``repeats`` runs; ``run`` returns keys processed."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        keys = run()
        rates.append(keys / (time.perf_counter() - start))
    return max(rates)


def bench_index(name: str, num_slots: int, chain_blocks: int, repeats: int) -> dict[str, float]:
    """Measure one index; every figure is the best of ``repeats`` runs."""
    num_chains = num_slots // chain_blocks
    resident = make_chains(num_chains, chain_blocks, seed=1)
    newcomers = make_chains(num_chains, chain_blocks, seed=2)
    index = build_index(name, num_slots)
    fill(index, resident)
    readable = [chain for chain in resident if index.lookup(chain) == len(chain)]
    if not readable:
        raise RuntimeError(f"index {name!r} admitted no whole chain; cannot benchmark lookups")

    def lookups() -> int:
        total = 0
        for chain in readable:
            total += index.lookup(chain)
        return total

    def pins() -> int:
        for chain in readable:
            index.pin(chain)
            index.unpin(chain)
        return 2 * sum(len(chain) for chain in readable)

    result = {
        "lookup_keys_per_s": best_rate(lookups, repeats),
        "pin_unpin_keys_per_s": best_rate(pins, repeats),
    }

    reserve_s, commit_s, reserved = [], [], 0
    batches = [newcomers, resident]
    for attempt in range(repeats):
        start = time.perf_counter()
        planned = [(chain, index.reserve(chain)) for chain in batches[attempt % 2]]
        middle = time.perf_counter()
        for chain, slots in planned:
            index.commit([key for key, slot in zip(chain, slots, strict=True) if slot is not None])
        end = time.perf_counter()
        index.take_events()
        count = sum(len(chain) for chain in batches[attempt % 2])
        reserved = sum(slot is not None for _, slots in planned for slot in slots)
        reserve_s.append(count / (middle - start))
        commit_s.append(max(reserved, 1) / (end - middle))
    result["reserve_keys_per_s"] = max(reserve_s)
    result["commit_keys_per_s"] = max(commit_s)
    result["reserved_fraction"] = reserved / sum(len(chain) for chain in batches[0])

    long_index = build_index(name, max(num_slots, LONG_CHAIN_BLOCKS))
    (long_chain,) = make_chains(1, LONG_CHAIN_BLOCKS, seed=3)
    fill(long_index, [long_chain])
    hits = long_index.lookup(long_chain)
    times = []
    for _ in range(repeats * 5):
        start = time.perf_counter()
        long_index.lookup(long_chain)
        times.append(time.perf_counter() - start)
    result["long_chain_hit_blocks"] = hits
    result["long_chain_lookup_s"] = statistics.median(times)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print JSON; exit status 1 if LRU misses a target."""
    registered = sorted(default_registry().of_kind(BLOCK_INDEX))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--index",
        action="append",
        choices=registered,
        help="registered block index to measure (repeatable; default: all, lru always included)",
    )
    parser.add_argument("--slots", type=int, default=32_768, help="tier slots (default 32768)")
    parser.add_argument("--chain-blocks", type=int, default=64, help="blocks per request chain")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure; the best is kept")
    args = parser.parse_args(argv)
    names = sorted(set(args.index or registered) | {"lru"})

    results = {
        name: bench_index(name, args.slots, args.chain_blocks, args.repeats) for name in names
    }
    lru = results["lru"]
    rate_keys = [
        "lookup_keys_per_s",
        "pin_unpin_keys_per_s",
        "reserve_keys_per_s",
        "commit_keys_per_s",
    ]
    for result in results.values():
        costs = {key: lru[key] / result[key] for key in rate_keys}
        costs["long_chain_lookup_s"] = result["long_chain_lookup_s"] / lru["long_chain_lookup_s"]
        result["cost_vs_lru"] = costs  # type: ignore[assignment]
        result["within_3x_lru"] = all(cost <= 3.0 for cost in costs.values())  # type: ignore[assignment]
    targets = {
        "lookup_keys_per_s": LOOKUP_TARGET_KEYS_PER_S,
        "long_chain_lookup_s": LONG_CHAIN_TARGET_S,
        "lru_lookup_met": lru["lookup_keys_per_s"] >= LOOKUP_TARGET_KEYS_PER_S,
        "lru_long_chain_met": lru["long_chain_lookup_s"] < LONG_CHAIN_TARGET_S,
    }
    report = {
        "benchmark": "index",
        "python": platform.python_version(),
        "slots": args.slots,
        "chain_blocks": args.chain_blocks,
        "long_chain_blocks": LONG_CHAIN_BLOCKS,
        "targets": targets,
        "indexes": results,
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if targets["lru_lookup_met"] and targets["lru_long_chain_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
