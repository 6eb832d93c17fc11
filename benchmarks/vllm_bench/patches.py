"""What the vLLM benchmarks change inside vLLM: timing wrappers around the connector, the host
copies, the engine step, the scheduler and the forward (:class:`Probes`), and swapping an
in-process engine's connector between rounds (:class:`ConnectorSwitch`). Nothing is patched
until a benchmark asks for it."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any


def timed_by(
    method: Callable[..., Any],
    record: Callable[[float], None],
    clock: Callable[[], float] = time.perf_counter,
) -> Callable[..., Any]:
    """``method``, handing the seconds each call took by ``clock`` to ``record``."""

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return method(*args, **kwargs)
        finally:
            record(clock() - started)

    return timed


class Probes:
    """Where an engine's time goes: connector calls, host copies, engine steps.

    :meth:`install` wraps the methods at class level, so it must run before the
    engine is built; only a process that installs probes pays for them.
    """

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}
        self.steps: list[dict[str, float]] = []

    def install(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from kvtier.copy.torch_backend import TorchCopyBackend
        from kvtier.integrations.vllm.connector import KVTierConnector

        for name, method in list(vars(KVTierConnector).items()):
            if callable(method) and not name.startswith("_"):
                setattr(KVTierConnector, name, self._timer(f"connector.{name}", method))
        # on CPU a submit is the whole copy, its checks of the ids included
        TorchCopyBackend.submit = self._timer("copy", TorchCopyBackend.submit)
        for name in ("step", "step_with_batch_queue"):
            setattr(EngineCore, name, self._step_timer(getattr(EngineCore, name)))
        Scheduler.schedule = self._schedule_probe(self._timer("vllm.schedule", Scheduler.schedule))
        Scheduler.update_from_output = self._timer(
            "vllm.update_from_output", Scheduler.update_from_output
        )
        # vLLM's CPU model runner inherits the forward from this one
        GPUModelRunner._model_forward = self._timer("vllm.forward", GPUModelRunner._model_forward)

    def take(self) -> dict[str, Any]:
        """The breakdown since the last call, then start over."""
        steps, calls = self.steps, self.calls
        self.steps, self.calls = [], {}
        ran = [step for step in steps if step.get("tokens", 0) > 0]

        def mean(key: str, of: list[dict[str, float]]) -> float:
            return statistics.fmean(step.get(key, 0.0) for step in of) if of else 0.0

        return {
            "steps": len(steps),
            "steps_with_tokens": len(ran),
            "step_s": sum(step.get("seconds", 0.0) for step in steps),
            "mean_batch_requests": mean("requests", ran),
            "mean_batch_tokens": mean("tokens", ran),
            "min_free_device_blocks": min((s["free_blocks"] for s in steps), default=0),
            "mean_free_device_blocks": mean("free_blocks", steps),
            "steps_with_requests_waiting_for_loads": sum(s["waiting_for_loads"] > 0 for s in steps),
            "steps_with_finished_requests_held": sum(s["finished_held"] > 0 for s in steps),
            "finished_request_steps_held": sum(s["finished_held"] for s in steps),
            "calls": {
                name: {"count": len(times), "total_s": sum(times), "max_s": max(times)}
                for name, times in sorted(calls.items())
            },
            "connector_total_s": sum(
                sum(times) for name, times in calls.items() if name.startswith("connector.")
            ),
        }

    def _timer(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def record(seconds: float) -> None:
            self.calls.setdefault(name, []).append(seconds)

        return timed_by(method, record)

    def _step_timer(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def record(seconds: float) -> None:
            if self.steps:
                self.steps[-1]["seconds"] = seconds

        return timed_by(method, record)

    def _schedule_probe(self, method: Callable[..., Any]) -> Callable[..., Any]:
        from vllm.v1.request import RequestStatus

        @functools.wraps(method)
        def probed(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            output = method(scheduler, *args, **kwargs)
            requests = scheduler.requests.values()
            self.steps.append(
                {
                    "requests": len(output.num_scheduled_tokens),
                    "tokens": output.total_num_scheduled_tokens,
                    "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                    "waiting_for_loads": sum(
                        r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in requests
                    ),
                    "finished_held": sum(r.is_finished() for r in requests),
                }
            )
            return output

        return probed


class ConnectorSwitch:
    """Takes kvtier out of an in-process engine between rounds, and puts it back.

    vLLM reaches its connector through two references: the scheduler's
    ``connector`` attribute and the worker side's process-wide connector agent
    (``has_kv_transfer_group()`` is whether it is set). With both ``None`` the
    scheduler and the model runner take the paths they take in an engine
    started without a connector; with both set to a :class:`NullConnector`
    they run vLLM's connector plumbing with nothing behind it. The scheduler's
    two connector-only statistics follow the connector. Swapping is safe only
    between rounds, when no request is alive and kvtier has nothing in flight:
    :meth:`use` checks both.
    """

    def __init__(self, llm: Any) -> None:
        from null_connector import NullConnector
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        if core is None:
            raise RuntimeError(
                "--throughput-method swap needs an in-process engine "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        scheduler = core.scheduler
        self._scheduler, self._state = scheduler, kv_transfer_state
        kept = ("connector", "connector_prefix_cache_stats", "_kv_fetch_stages")
        missing = [name for name in kept if not hasattr(scheduler, name)]
        if not hasattr(kv_transfer_state, "_KV_CONNECTOR_AGENT"):
            missing.append("kv_transfer_state._KV_CONNECTOR_AGENT")
        if missing or scheduler.connector is None:
            raise RuntimeError(
                f"this vLLM keeps its connector elsewhere ({', '.join(missing) or 'no connector'}"
                "); use --throughput-method pairs"
            )
        self.kvtier = scheduler.connector
        stats = (scheduler.connector_prefix_cache_stats, scheduler._kv_fetch_stages)
        null = [
            NullConnector(scheduler.vllm_config, role, scheduler.kv_cache_config)
            for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
        ]
        self._kinds = {
            "kvtier": (self.kvtier, kv_transfer_state._KV_CONNECTOR_AGENT, *stats),
            "null": (*null, *stats),
            "none": (None, None, None, None),
        }

    def use(self, kind: str) -> None:
        """Run the next rounds with ``kind`` (one of :data:`SWAP_KINDS`)."""
        scheduler = self._scheduler
        if scheduler.has_requests() or not self.kvtier.manager.settled:
            raise RuntimeError("connectors can only be swapped between rounds")
        (
            scheduler.connector,
            self._state._KV_CONNECTOR_AGENT,
            scheduler.connector_prefix_cache_stats,
            scheduler._kv_fetch_stages,
        ) = self._kinds[kind]
