"""Offload: the scheduler-side manager that plans transfers and the worker side that runs them.

The scheduler side is :class:`OffloadManager`, which every engine drives through an
:class:`OffloadSession` (:mod:`~kvtier.offload.session`: each request's decisions and the
calls' order). The manager is a facade over modules that each own one piece of state and
say whether they are idle (:mod:`~kvtier.offload.quiet`): the request table and window
logic (:mod:`~kvtier.offload.requests`), planning (:mod:`~kvtier.offload.planner`, with
:mod:`~kvtier.offload.frontier` for lazy mode), the batch ledger
(:mod:`~kvtier.offload.ledger`), the moves to and from the tiers below the host tier
(:mod:`~kvtier.offload.moves`), the cost guard that skips loads predicted slower than
recomputing (:mod:`~kvtier.offload.costguard`), the counters (:mod:`~kvtier.offload.stats`)
and every tier's KV-cache events (:mod:`~kvtier.offload.events`); what they all read is
:mod:`~kvtier.offload.setup`. The worker side is :class:`OffloadWorker`, which binds each
plan and reports back over three parts, one per pair of media and one for requests: the
copies between the device and the host tier, with deadlines (:mod:`~kvtier.offload.copies`),
the moves between the host tier and the lower tiers, with the blocks a close still owes them
(:mod:`~kvtier.offload.tier_mover`), and which requests are done
(:mod:`~kvtier.offload.completions`).

With lower tiers, a block the host tier evicts is demoted: the next plan has workers
copy it out of its slot, before anything reuses the slot, and write it to every lower
tier. Slots are never reused while a copy might still write them: a failed batch's
slots stay quarantined until every worker said its copy is over.
"""

from kvtier.offload.completions import LoadFailures
from kvtier.offload.copies import BackendFactory
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
from kvtier.offload.session import OffloadSession
from kvtier.offload.setup import GroupBlockIds, StoreMode
from kvtier.offload.stats import Observations, OffloadStats
from kvtier.offload.worker import OffloadWorker

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
    "OffloadSession",
    "OffloadStats",
    "OffloadWorker",
    "Progress",
    "Promotion",
    "StoreMode",
    "Transfer",
    "TransferPlan",
    "WorkerReport",
]
