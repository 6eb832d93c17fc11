"""Offload: the scheduler-side manager that plans transfers and the worker side that runs them."""

from kvtier.offload.failures import FailureCause
from kvtier.offload.frontier import EvictionFrontier
from kvtier.offload.ledger import Progress
from kvtier.offload.manager import OffloadManager
from kvtier.offload.messages import (
    Demotion,
    DeviceBlock,
    LazyCandidate,
    Promotion,
    Transfer,
    TransferPlan,
    WorkerReport,
)
from kvtier.offload.setup import GroupBlockIds, StoreMode
from kvtier.offload.stats import Observations, OffloadStats
from kvtier.offload.worker import BackendFactory, LoadFailures, OffloadWorker

__all__ = [
    "BackendFactory",
    "Demotion",
    "DeviceBlock",
    "EvictionFrontier",
    "FailureCause",
    "GroupBlockIds",
    "LazyCandidate",
    "LoadFailures",
    "Observations",
    "OffloadManager",
    "OffloadStats",
    "OffloadWorker",
    "Progress",
    "Promotion",
    "StoreMode",
    "Transfer",
    "TransferPlan",
    "WorkerReport",
]
