"""``kvtier simulate --tiers``: capacities for the host tier and each tier below it.

``host=4000,disk=64000`` replays a host tier of 4000 blocks over a disk tier
of 64000; a tier given several capacities (``host=2000/4000,disk=64000/128000``)
is replayed at each of them, every combination once. The host tier comes
first; the tiers below it follow in lookup order, each named as in the
results (its type, as in the config's ``tiers``).
"""

from __future__ import annotations

import itertools

HOST = "host"
"""The name of the host tier in ``--tiers``."""

LowerChain = tuple[tuple[str, int], ...]
"""The tiers below the host tier of one replay: (name, capacity in blocks), in lookup order."""


def parse_tiers(text: str) -> tuple[list[int], list[LowerChain]]:
    """Parse a ``--tiers`` value into host capacities and the lower-tier chains to replay.

    Raises:
        ValueError: The value is not ``host=N[/N...],NAME=N[/N...],...`` with
            whole, positive block counts and each name once; the message says which part.
    """
    parts = [part.strip() for part in text.split(",") if part.strip()]
    tiers: list[tuple[str, list[int]]] = []
    for part in parts:
        name, equals, sizes = part.partition("=")
        name = name.strip()
        if not equals or not name:
            raise ValueError(f"{part!r} is not NAME=BLOCKS (e.g. disk=64000)")
        try:
            capacities = [int(size) for size in sizes.split("/")]
        except ValueError:
            raise ValueError(
                f"{part!r}: capacities are whole numbers of blocks, several joined by '/'"
            ) from None
        if any(capacity <= 0 for capacity in capacities):
            raise ValueError(f"{part!r}: every capacity must hold at least one block")
        if name in (tier for tier, _ in tiers):
            raise ValueError(f"{name!r} is given twice")
        tiers.append((name, capacities))
    if not tiers or tiers[0][0] != HOST:
        raise ValueError(f"start with the host tier, e.g. {HOST}=4000,disk=64000")
    lower = tiers[1:]
    chains = [
        tuple(zip([name for name, _ in lower], combination, strict=True))
        for combination in itertools.product(*(capacities for _, capacities in lower))
    ]
    return tiers[0][1], chains
