"""kvtier's log records inside vLLM: the same stream and format as vLLM's, and one start-up line.

vLLM configures only its own ``vllm`` logger; records of any other library
reach no handler, so their INFO lines are lost and their warnings are
printed bare by Python's last-resort handler. :func:`join_vllm_logging`
hands the ``kvtier`` logger vLLM's handlers, so kvtier's records carry vLLM's
process name, pid, level and time. Outside vLLM nothing changes: kvtier logs
through plain :mod:`logging` as any library does.
"""

from __future__ import annotations

import logging

from kvtier.config import DEFAULT_SOURCE, KVTierConfig
from kvtier.config.units import human_bytes

KVTIER_LOGGER = "kvtier"
VLLM_LOGGER = "vllm"


def join_vllm_logging() -> bool:
    """Send kvtier's records to the handlers vLLM configured, at vLLM's level.

    Nothing changes when vLLM configured no handler (``VLLM_CONFIGURE_LOGGING=0``)
    or when the ``kvtier`` logger already has handlers of its own (whoever
    added them decides). Records still propagate to the root logger, so a
    handler installed there (pytest's, an application's) sees them too.

    Returns:
        Whether kvtier's logger now uses vLLM's handlers.
    """
    vllm_logger = logging.getLogger(VLLM_LOGGER)
    kvtier_logger = logging.getLogger(KVTIER_LOGGER)
    if not vllm_logger.handlers:
        return False
    if kvtier_logger.handlers:
        return kvtier_logger.handlers == vllm_logger.handlers
    for handler in vllm_logger.handlers:
        kvtier_logger.addHandler(handler)
    kvtier_logger.setLevel(vllm_logger.level)
    return True


def startup_summary(config: KVTierConfig, *, role: str, record_bytes: int, world_size: int) -> str:
    """One line that says how this process's side of kvtier is set up, and what set it.

    Args:
        config: The validated config.
        role: ``"scheduler"`` or ``"worker"``.
        record_bytes: Bytes of one block record, all layers of one rank.
        world_size: Ranks the host tier is split over.

    Returns:
        E.g. ``kvtier worker: eager store mode, host tier 64MiB per rank (2048 slots of 32KiB,
        world size 1), policy prefix_arc, copy torch, layout auto; set: cpu_bytes=64MiB
        (file kvtier.yaml)``.
    """
    per_rank = config.host_bytes_per_rank(world_size)
    slots = config.host_slots(record_bytes, world_size)
    values = config.model_dump(mode="json")
    chosen = []
    for path, source in config.sources().items():
        if source == DEFAULT_SOURCE:
            continue
        value = values
        for part in path.split("."):
            value = value[part]
        chosen.append(f"{path}={_shown(path, value)} ({source})")
    return (
        f"kvtier {role}: {config.store_mode} store mode, "
        f"host tier {human_bytes(per_rank)} per rank "
        f"({slots} slots of {human_bytes(record_bytes)}, world size {world_size}), "
        f"policy {config.index.type}, copy {config.copy.type}, layout {config.layout.type}; "
        f"set: {', '.join(chosen) if chosen else 'nothing (all defaults)'}"
    )


def _shown(path: str, value: object) -> str:
    if path.rsplit(".", 1)[-1].endswith("_bytes") and isinstance(value, int):
        return human_bytes(value)
    return str(value)
