"""Offload: the scheduler-side manager that plans transfers and the worker side that runs them."""

from kvtier.offload.failures import FailureCause
from kvtier.offload.manager import (
    GroupBlockIds,
    Observations,
    OffloadManager,
    OffloadStats,
    Progress,
    StoreMode,
)
from kvtier.offload.messages import (
    Demotion,
    DeviceBlock,
    LazyCandidate,
    Promotion,
    Transfer,
    TransferPlan,
    WorkerReport,
)
from kvtier.offload.worker import BackendFactory, LoadFailures, OffloadWorker

__all__ = [
    "BackendFactory",
    "Demotion",
    "DeviceBlock",
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
