"""Offload: the scheduler-side manager that plans transfers and the worker side that runs them."""

from kvtier.offload.manager import GroupBlockIds, OffloadManager, OffloadStats, Progress, StoreMode
from kvtier.offload.messages import (
    DeviceBlock,
    LazyCandidate,
    Transfer,
    TransferPlan,
    WorkerReport,
)
from kvtier.offload.worker import BackendFactory, LoadFailures, OffloadWorker

__all__ = [
    "BackendFactory",
    "DeviceBlock",
    "GroupBlockIds",
    "LazyCandidate",
    "LoadFailures",
    "OffloadManager",
    "OffloadStats",
    "OffloadWorker",
    "Progress",
    "StoreMode",
    "Transfer",
    "TransferPlan",
    "WorkerReport",
]
