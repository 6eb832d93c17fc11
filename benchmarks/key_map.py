"""A step's key lookups in a large key -> slot map: a Python dict against a numpy hash table.

The host tier's index maps each block key (32 bytes) to its slot. On a busy
engine the map is large and the engine's own work runs between two of
kvtier's calls, so the map's memory has left the CPU's caches by the time a
step's keys are looked up. This benchmark measures that case: ``--slots``
keys held, a batch of ``--keys`` keys looked up per step (alternately a run
of consecutive keys, as a stored chain, and keys drawn at random), a 64 MiB
array read before every lookup to evict the caches. The two arms alternate,
their order swapped every other step:

- ``dict``: a list comprehension over the dict;
- ``numpy``: an open-addressing table of the keys' first 8 bytes (the slot
  beside each), probed for the whole batch at once after one ``bytes.join``
  of the batch.

Output: one JSON object with ``slots``, ``steps`` and per batch size (``keys``)
each arm's median microseconds per step and per key (CPU time of the thread),
and ``numpy_over_dict``, the ratio of the medians.

    python benchmarks/key_map.py [--slots 400000] [--keys 16,128,1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

EVICT_BYTES = 64 << 20
"""Bytes read before each lookup: more than the machine's last-level cache."""


class NumpyKeyMap:
    """Slots of keys in an open-addressing table of their first 8 bytes (linear probing)."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        capacity = 1 << (2 * len(keys) - 1).bit_length()  # at most half full
        self._mask = np.uint64(capacity - 1)
        self._hashes = np.zeros(capacity, np.uint64)
        self._slots = np.full(capacity, -1, np.int64)
        for slot, key_hash in enumerate(self.hashes(keys).tolist()):
            place = key_hash & (capacity - 1)
            while self._slots[place] != -1:
                place = (place + 1) & (capacity - 1)
            self._hashes[place] = key_hash
            self._slots[place] = slot

    @staticmethod
    def hashes(keys: Sequence[bytes]) -> np.ndarray:
        width = len(keys[0]) // 8
        return np.frombuffer(b"".join(keys), dtype=np.uint64)[::width]

    def lookup(self, keys: Sequence[bytes]) -> np.ndarray:
        """Each key's slot, -1 for a key not held (its probe reached an empty place)."""
        wanted = self.hashes(keys)
        places = (wanted & self._mask).astype(np.int64)
        slots = self._slots[places]
        going = (self._hashes[places] != wanted) & (slots != -1)
        while going.any():
            places[going] = (places[going] + 1) & int(self._mask)
            slots[going] = self._slots[places[going]]
            going &= (self._hashes[places] != wanted) & (slots != -1)
        return slots


def measure(
    keys: list[bytes], table: dict[bytes, int], array_map: NumpyKeyMap, batch: int, steps: int
) -> dict[str, dict[str, float]]:
    """Each arm's median time per step and per key over ``steps`` lookups of ``batch`` keys."""
    rng = np.random.default_rng(0)
    slots = len(keys)
    junk = np.ones(EVICT_BYTES // 8)
    arms: dict[str, Callable[[list[bytes]], object]] = {
        "dict": lambda wanted: [table[key] for key in wanted],
        "numpy": array_map.lookup,
    }
    times: dict[str, list[int]] = {name: [] for name in arms}
    for step in range(steps):
        if step % 2:
            start = int(rng.integers(0, slots - batch))
            wanted = keys[start : start + batch]
        else:
            wanted = [keys[i] for i in rng.integers(0, slots, batch)]
        order = list(arms) if step % 4 < 2 else list(reversed(arms))
        for name in order:
            junk.sum()
            started = time.thread_time_ns()
            arms[name](wanted)
            times[name].append(time.thread_time_ns() - started)
    return {
        name: {
            "us_per_step": statistics.median(values) / 1e3,
            "us_per_key": statistics.median(values) / 1e3 / batch,
        }
        for name, values in times.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=400_000, help="keys held (default 400000)")
    parser.add_argument("--keys", default="16,128,1024", help="comma list of keys per step")
    parser.add_argument("--steps", type=int, default=200, help="steps per batch size")
    args = parser.parse_args(argv)
    keys = [os.urandom(32) for _ in range(args.slots)]
    table = {key: slot for slot, key in enumerate(keys)}
    array_map = NumpyKeyMap(keys)
    if array_map.lookup(keys).tolist() != list(range(args.slots)):
        raise AssertionError("the numpy table found other slots than the dict")
    batches = []
    for batch in (int(each) for each in args.keys.split(",")):
        arms = measure(keys, table, array_map, batch, args.steps)
        ratio = arms["numpy"]["us_per_step"] / arms["dict"]["us_per_step"]
        batches.append({"keys": batch, **arms, "numpy_over_dict": round(ratio, 3)})
    json.dump({"slots": args.slots, "steps": args.steps, "batches": batches}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
