"""Block-index benchmark: the cost per key of each index operation, per registered index.

Every registered block index (or those named with ``--index``; ``lru`` is
always included) runs the same workload: a tier of ``--slots`` slots is filled
with chains of ``--chain-blocks`` keys, named as an engine integration names
them. Every rate is the median over ``--repeats`` runs, never the best run.

Reserves are measured where they cost the most, in a full tier: each run
offers chains never stored before, so every slot a reserve returns evicts a
readable key. A policy with an admission filter may decline a chain on first
sight; the chain is then offered a second time, as a prefix that comes back
would be, and only the calls that reserved a slot count as evicting reserves.
Declining calls are reported apart, so a filter that declines everything
cannot pass for a cheap reserve.

Output: one JSON object.

- ``benchmark``: ``"index"``.
- ``python``: the Python version.
- ``slots``, ``chain_blocks``, ``repeats``: the arguments.
- ``long_chain_blocks``: blocks in the long chain of ``long_chain_lookup_s`` (8,192).
- ``targets``: ``lookup_keys_per_s`` and ``long_chain_lookup_s``, the targets
  for ``lru``; ``lru_lookup_met`` and ``lru_long_chain_met``, whether ``lru``
  met them (the exit status is 1 if not).
- ``indexes``: per index name:

  - ``lookup_keys_per_s``: keys per second of :meth:`BlockIndex.lookup` on
    chains that are readable in full (every key a hit).
  - ``pin_unpin_keys_per_s``: keys per second of ``pin`` then ``unpin`` of
    readable chains, counting each call's keys (two per key).
  - ``reserve_evict_keys_per_s``: keys per second of ``reserve`` calls that
    reserved at least one slot in the full tier: slots reserved divided by the
    time of those calls (declined keys in the same call add time, not keys).
  - ``evictions_per_reserved_key``: keys evicted during those reserves per
    slot reserved; 1.0 shows that every counted reserve evicted.
  - ``first_offer_declined_fraction``: share of the offered keys declined on
    their first offer (0.0 for an index without an admission filter).
  - ``reserve_decline_keys_per_s``: keys per second of ``reserve`` calls that
    reserved nothing (the filter declined the whole chain); ``null`` when no
    call did.
  - ``commit_keys_per_s``: keys per second of ``commit`` of the reserved keys.
  - ``long_chain_hit_blocks``: blocks of the long chain readable after storing it.
  - ``long_chain_lookup_s``: median seconds of one ``lookup`` of the long chain.
  - ``cost_vs_lru``: per rate above and ``long_chain_lookup_s``, the cost per
    key relative to ``lru`` measured in the same run (1.0 is as fast as
    ``lru``, 2.0 twice as slow); ``reserve_decline_keys_per_s`` is compared
    with ``lru``'s evicting reserve and is ``null`` when there was no such call.
  - ``within_3x_lru``: whether every ``cost_vs_lru`` figure is at most 3.0.

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
from typing import Any

from kvtier.index.base import BlockIndex, BlockKey, EventKind
from kvtier.keys import KeyNamespace, hash_token_blocks
from kvtier.kinds import BLOCK_INDEX
from kvtier.plugins import default_registry

LONG_CHAIN_BLOCKS = 8192
LOOKUP_TARGET_KEYS_PER_S = 1_000_000
LONG_CHAIN_TARGET_S = 5e-3
RATE_KEYS = (
    "lookup_keys_per_s",
    "pin_unpin_keys_per_s",
    "reserve_evict_keys_per_s",
    "commit_keys_per_s",
)


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


def store_chain(index: BlockIndex, chain: list[BlockKey]) -> list[BlockKey]:
    """Reserve ``chain`` and commit the keys that got a slot; return those keys."""
    slots = index.reserve(chain)
    reserved = [key for key, slot in zip(chain, slots, strict=True) if slot is not None]
    index.commit(reserved)
    return reserved


def fill(index: BlockIndex, chains: list[list[BlockKey]]) -> None:
    """Store every chain, offering a chain the policy declined a second time."""
    for chain in chains:
        if not store_chain(index, chain):
            store_chain(index, chain)
    index.take_events()


def median_rate(run: Callable[[], int], repeats: int) -> float:
    """Keys per second of the median of ``repeats`` runs; ``run`` returns keys processed."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        keys = run()
        rates.append(keys / (time.perf_counter() - start))
    return statistics.median(rates)


def store_round(index: BlockIndex, chains: list[list[BlockKey]]) -> dict[str, float]:
    """Store ``chains`` in a full tier, timing every reserve and commit call.

    Returns seconds and key counts of the reserves that reserved a slot
    (``evict_s``, ``reserved``), of those that reserved nothing (``decline_s``,
    ``declined``), of the commits (``commit_s``), the keys declined on their
    first offer (``first_declined``) and the keys evicted (``evicted``).
    """
    counts = dict.fromkeys(
        ("evict_s", "reserved", "decline_s", "declined", "commit_s", "first_declined"), 0.0
    )
    evicted = 0
    for chain in chains:
        for offer in range(2):
            start = time.perf_counter()
            slots = index.reserve(chain)
            middle = time.perf_counter()
            reserved = [key for key, slot in zip(chain, slots, strict=True) if slot is not None]
            if offer == 0:
                counts["first_declined"] += len(chain) - len(reserved)
            if not reserved:
                counts["decline_s"] += middle - start
                counts["declined"] += len(chain)
                continue
            counts["evict_s"] += middle - start
            counts["reserved"] += len(reserved)
            before_commit = time.perf_counter()
            index.commit(reserved)
            counts["commit_s"] += time.perf_counter() - before_commit
            # Eviction events are read outside the timed calls.
            evicted += sum(event.kind is EventKind.EVICTED for event in index.take_events())
            if len(reserved) == len(chain):
                break
    counts["evicted"] = evicted
    return counts


def bench_index(name: str, num_slots: int, chain_blocks: int, repeats: int) -> dict[str, Any]:
    """Measure one index; every rate is the median of ``repeats`` runs."""
    num_chains = num_slots // chain_blocks
    resident = make_chains(num_chains, chain_blocks, seed=1)
    index = build_index(name, num_slots)
    fill(index, resident)
    readable = [chain for chain in resident if index.lookup(chain) == len(chain)]
    if not readable:
        raise RuntimeError(f"index {name!r} holds no whole chain; cannot benchmark lookups")

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

    result: dict[str, Any] = {
        "lookup_keys_per_s": median_rate(lookups, repeats),
        "pin_unpin_keys_per_s": median_rate(pins, repeats),
    }

    # Fill what is still free, so that every reserve below evicts.
    fill(index, make_chains(num_chains, chain_blocks, seed=2))
    rounds = [
        store_round(index, make_chains(num_chains, chain_blocks, seed=10 + attempt))
        for attempt in range(repeats)
    ]
    if not any(counts["reserved"] for counts in rounds):
        raise RuntimeError(f"index {name!r} reserved no slot in a full tier; nothing evicted")
    result["reserve_evict_keys_per_s"] = statistics.median(
        counts["reserved"] / counts["evict_s"] for counts in rounds if counts["reserved"]
    )
    result["evictions_per_reserved_key"] = sum(c["evicted"] for c in rounds) / sum(
        c["reserved"] for c in rounds
    )
    offered = repeats * num_chains * chain_blocks
    result["first_offer_declined_fraction"] = sum(c["first_declined"] for c in rounds) / offered
    declining = [
        counts["declined"] / counts["decline_s"] for counts in rounds if counts["declined"]
    ]
    result["reserve_decline_keys_per_s"] = statistics.median(declining) if declining else None
    result["commit_keys_per_s"] = statistics.median(
        counts["reserved"] / counts["commit_s"] for counts in rounds if counts["reserved"]
    )

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


def costs_vs_lru(result: dict[str, Any], lru: dict[str, Any]) -> dict[str, float | None]:
    """Cost per key of each of ``result``'s figures relative to ``lru``'s (2.0: twice as slow)."""
    costs: dict[str, float | None] = {key: lru[key] / result[key] for key in RATE_KEYS}
    decline = result["reserve_decline_keys_per_s"]
    costs["reserve_decline_keys_per_s"] = (
        None if decline is None else lru["reserve_evict_keys_per_s"] / decline
    )
    costs["long_chain_lookup_s"] = result["long_chain_lookup_s"] / lru["long_chain_lookup_s"]
    return costs


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
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs per figure; the median is kept (default 5)"
    )
    args = parser.parse_args(argv)
    if args.slots < args.chain_blocks or args.chain_blocks <= 0 or args.repeats <= 0:
        parser.error("--chain-blocks and --repeats must be positive and --slots >= --chain-blocks")
    names = sorted(set(args.index or registered) | {"lru"})

    results = {
        name: bench_index(name, args.slots, args.chain_blocks, args.repeats) for name in names
    }
    lru = results["lru"]
    for result in results.values():
        costs = costs_vs_lru(result, lru)
        result["cost_vs_lru"] = costs
        result["within_3x_lru"] = all(cost is None or cost <= 3.0 for cost in costs.values())
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
        "repeats": args.repeats,
        "long_chain_blocks": LONG_CHAIN_BLOCKS,
        "targets": targets,
        "indexes": results,
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if targets["lru_lookup_met"] and targets["lru_long_chain_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
