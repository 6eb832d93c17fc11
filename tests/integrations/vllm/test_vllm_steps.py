"""kvtier's connector in vLLM's real scheduler, stepped without a model (vLLM 0.32 and 0.33).

:class:`~tests.support.vllm_steps.VllmSteps` runs vLLM's ``Scheduler`` with
both halves of the connector over CPU tensors in vLLM's own layouts; every
block loaded from the tier is checked byte for byte. These tests run with
whichever supported vLLM is installed: 0.32 in the main environment, 0.33 in
the second one (``make test`` builds both).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import kvtier  # noqa: E402
import kvtier.plugins  # noqa: E402
from kvtier.copy.base import Direction  # noqa: E402
from tests.support.faults import flaky_copy_registry  # noqa: E402
from tests.support.vllm_steps import StepsSpec, VllmSteps, write_model_config  # noqa: E402

pytestmark = pytest.mark.vllm033

BLOCK = 16
MIB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("tiny-llama-config"))


@pytest.fixture
def engine_factory(model_dir: Path) -> Iterator[Callable[..., VllmSteps]]:
    engines: list[VllmSteps] = []

    def build(kvtier_config: dict[str, Any] | None = None, **spec: Any) -> VllmSteps:
        engine = VllmSteps(model_dir, kvtier_config or {"cpu_bytes": 4 * MIB}, StepsSpec(**spec))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


def prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def reset_device_cache(engine: VllmSteps) -> None:
    assert engine.scheduler.reset_prefix_cache(), "vLLM's own prefix cache could not be reset"


@pytest.mark.parametrize(
    "layout, kernel_block_tokens",
    [("LBNHC", None), ("LBHNC", None), ("BLHNC", None), ("LHBNC", None), ("LBHNC", 8)],
)
def test_stored_blocks_are_loaded_back_byte_for_byte(
    engine_factory: Callable[..., VllmSteps], layout: str, kernel_block_tokens: int | None
) -> None:
    engine = engine_factory(layout=layout, kernel_block_tokens=kernel_block_tokens)
    batch = prompts(1, 4, 40, 120)
    cold = engine.generate(batch, max_tokens=3)
    manager = engine.connector.manager
    # the KV of every token but the last sampled one is computed, and its full blocks stored
    assert manager.stats().stored_blocks == sum((len(p) + 2) // BLOCK for p in batch)
    full_blocks = sum(len(p) // BLOCK for p in batch)
    reset_device_cache(engine)
    warm = engine.generate(batch, max_tokens=3)
    assert warm == cold
    assert engine.mismatches == []
    assert engine.loaded_blocks == full_blocks
    assert manager.stats().hit_tokens == full_blocks * BLOCK
    assert engine.counter("hit_tokens") == full_blocks * BLOCK
    assert engine.counter("loaded_blocks") == full_blocks
    assert manager.num_requests == 0 and manager.index.stats().pinned == 0
    assert engine.connector.scheduler.session.tokens.num_requests == 0, (
        "finished requests' tokens kept"
    )


def test_kv_transfer_params_limit_stores_pin_them_and_refuse_loads(
    engine_factory: Callable[..., VllmSteps],
) -> None:
    engine = engine_factory()
    batch = prompts(3, 3, 70, 120)
    control = {"kvtier": {"store_max_tokens": 2 * BLOCK + 5, "pin_s": 60, "priority": "high"}}
    for prompt in batch:
        engine.add(prompt, max_tokens=3, kv_transfer_params=control)
    engine.run()
    manager = engine.connector.manager
    assert manager.stats().stored_blocks == 2 * len(batch)
    assert manager.index.stats().pinned == 2 * len(batch)
    reset_device_cache(engine)
    for prompt in batch:
        engine.add(prompt, kv_transfer_params={"kvtier": {"load": False}, "other": 1})
    engine.run()
    assert manager.stats().hit_tokens == 0
    reset_device_cache(engine)
    engine.generate(batch)
    assert manager.stats().hit_tokens == sum(len(p) // BLOCK for p in batch) * BLOCK
    assert engine.mismatches == []
    assert manager.num_requests == 0 and engine.connector.scheduler.session.requests == {}


def test_a_request_waits_for_its_load_before_it_runs(
    engine_factory: Callable[..., VllmSteps],
) -> None:
    from vllm.v1.request import RequestStatus

    engine = engine_factory({"cpu_bytes": 4 * MIB, "same_step_load_bytes": 0})
    (prompt,) = prompts(2, 1, 70, 71)
    engine.generate([prompt])
    reset_device_cache(engine)
    request_id = engine.add(prompt)
    first = engine.step()
    assert first.num_scheduled_tokens == {}, "nothing runs while the load is in flight"
    assert engine.scheduler.requests[request_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [len(t) for t in first.kv_connector_metadata.plan.loads] == [len(prompt) // BLOCK]
    engine.run()
    assert engine.loaded_blocks == len(prompt) // BLOCK and engine.mismatches == []
    assert engine.connector.manager.stats().same_step_loaded_blocks == 0


@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
@pytest.mark.parametrize("failing", [False, True], ids=["load_completes", "load_fails"])
def test_a_request_aborted_while_its_load_runs_is_freed_once(
    engine_factory: Callable[..., VllmSteps],
    monkeypatch: pytest.MonkeyPatch,
    store_mode: str,
    failing: bool,
) -> None:
    """vLLM frees an aborted request's blocks at the first report naming it (load ended,
    or blocks released), and asserts that no second report names it."""
    from vllm.v1.request import RequestStatus

    slow = flaky_copy_registry(
        fail=lambda batch: failing and batch.direction is Direction.LOAD, delay_polls=3
    )
    monkeypatch.setattr(kvtier.plugins, "_default_registry", slow)
    engine = engine_factory(
        {
            "cpu_bytes": 4 * MIB,
            "copy": {"type": "flaky"},
            "store_mode": store_mode,
            "same_step_load_bytes": 0,
        },
        num_blocks=40,
    )
    (prompt,) = prompts(12, 1, 70, 71)
    engine.generate([prompt])
    if store_mode == "lazy":  # lazy mode stores blocks as vLLM evicts them: push them out
        engine.generate(prompts(13, 6, 150, 200))
    reset_device_cache(engine)
    request_id = engine.add(prompt)
    engine.step()
    assert engine.scheduler.requests[request_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
    assert request_id in engine.scheduler.requests, "vLLM keeps its blocks until the load ends"
    engine.run()
    assert request_id not in engine.scheduler.requests
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.spec.num_blocks - 1, "a block was not freed"
    manager = engine.connector.manager
    assert manager.num_requests == 0 and manager.num_inflight_batches == 0
    assert manager.index.stats().pinned == 0


@pytest.mark.parametrize(
    ("length", "computed"),
    [(70, 70 - 4 * BLOCK), (64, 1)],
    ids=["a_partial_last_block", "a_whole_prompt_leaves_its_last_token"],
)
def test_a_hit_within_the_same_step_budget_runs_in_the_step_that_loads_it(
    engine_factory: Callable[..., VllmSteps], length: int, computed: int
) -> None:
    from vllm.v1.request import RequestStatus

    engine = engine_factory()
    (prompt,) = prompts(2, 1, length, length + 1)
    cold = engine.generate([prompt], max_tokens=3)
    reset_device_cache(engine)
    request_id = engine.add(prompt, max_tokens=3)
    first = engine.step()
    assert first.num_scheduled_tokens == {request_id: computed}
    assert first.kv_connector_metadata.plan.same_step == {request_id}
    assert [len(t) for t in first.kv_connector_metadata.plan.loads] == [4]
    assert engine.scheduler.requests[request_id].status == RequestStatus.RUNNING
    assert engine.loaded_blocks == 4 and engine.mismatches == []
    engine.run()
    assert engine.outputs[request_id] == cold[0]
    assert engine.counter("loaded_blocks") == engine.counter("same_step_loaded_blocks") == 4


def test_after_a_device_hit_the_last_tokens_block_is_loaded_in_the_same_step(
    engine_factory: Callable[..., VllmSteps],
) -> None:
    engine = engine_factory()
    (prompt,) = prompts(3, 1, 64, 65)
    cold = engine.generate([prompt], max_tokens=2)
    # vLLM's own cache holds the first three blocks (never the last token's): the tier the last
    request_id = engine.add(prompt, max_tokens=2)
    first = engine.step()
    assert first.num_scheduled_tokens == {request_id: 1}
    assert [t.device_blocks for t in first.kv_connector_metadata.plan.loads] == [
        (engine.scheduler.kv_cache_manager.get_blocks(request_id).get_block_ids()[0][3],)
    ]
    engine.run()
    assert engine.outputs[request_id] == cold[0]
    assert engine.loaded_blocks == 1 and engine.mismatches == []


def test_hits_past_the_same_step_budget_are_loaded_a_step_ahead(
    engine_factory: Callable[..., VllmSteps],
) -> None:
    from vllm.v1.request import RequestStatus

    record_bytes = engine_factory().connector.scheduler.record_bytes
    engine = engine_factory({"cpu_bytes": 4 * MIB, "same_step_load_bytes": 5 * record_bytes})
    batch = [prompt[:70] for prompt in prompts(4, 2, 70, 71)]
    cold = engine.generate(batch, max_tokens=2)
    reset_device_cache(engine)
    first_id, second_id = (engine.add(prompt, max_tokens=2) for prompt in batch)
    first = engine.step()
    assert first.kv_connector_metadata.plan.same_step == {first_id}
    assert first.num_scheduled_tokens == {first_id: 70 - 4 * BLOCK}
    assert engine.scheduler.requests[second_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    second = engine.step()
    assert second.kv_connector_metadata.plan.same_step == frozenset()
    engine.run()
    assert [engine.outputs[first_id], engine.outputs[second_id]] == cold
    assert engine.loaded_blocks == 8 and engine.mismatches == []
    stats = engine.connector.manager.stats()
    assert (stats.loaded_blocks, stats.same_step_loaded_blocks) == (8, 4)


def test_preempted_requests_keep_their_outputs(engine_factory: Callable[..., VllmSteps]) -> None:
    batch = prompts(3, 8, 100, 200)
    reference = engine_factory(num_blocks=256).generate(batch, max_tokens=24)
    engine = engine_factory({"cpu_bytes": 8 * MIB}, num_blocks=40)
    assert engine.generate(batch, max_tokens=24) == reference
    assert engine.preemptions > 0, "the device cache was meant to be too small"
    assert engine.mismatches == []
    manager = engine.connector.manager
    assert manager.num_requests == 0 and manager.num_inflight_batches == 0


def test_finished_requests_are_held_until_their_stores_complete(
    engine_factory: Callable[..., VllmSteps],
) -> None:
    engine = engine_factory()
    (prompt,) = prompts(4, 1, 64, 65)
    request_id = engine.add(prompt, max_tokens=1)
    engine.step()
    assert request_id in engine.finished
    assert request_id in engine.scheduler.requests, "its blocks are still being stored"
    engine.run()
    assert request_id not in engine.scheduler.requests
    assert engine.connector.manager.stats().stored_blocks == len(prompt) // BLOCK


@pytest.mark.parametrize("same_step_load_bytes", [0, 4 * MIB], ids=["a_step_ahead", "same_step"])
def test_failed_loads_are_recomputed(
    engine_factory: Callable[..., VllmSteps],
    monkeypatch: pytest.MonkeyPatch,
    same_step_load_bytes: int,
) -> None:
    failing_loads = flaky_copy_registry(fail=lambda batch: batch.direction is Direction.LOAD)
    monkeypatch.setattr(kvtier.plugins, "_default_registry", failing_loads)
    engine = engine_factory(
        {
            "cpu_bytes": 4 * MIB,
            "copy": {"type": "flaky"},
            "same_step_load_bytes": same_step_load_bytes,
        }
    )
    batch = prompts(5, 3, 40, 100)
    cold = engine.generate(batch, max_tokens=4)
    reset_device_cache(engine)
    assert engine.generate(batch, max_tokens=4) == cold
    stats = engine.connector.manager.stats()
    full_blocks = sum(len(p) // BLOCK for p in batch)
    assert stats.hit_tokens == full_blocks * BLOCK
    assert stats.loaded_blocks == 0
    assert stats.load_failures == engine.failed_blocks == full_blocks
    # the worker counts its failed copies; the scheduler has no cause of its own here
    failures = [payload["failures"] for payload in engine.connector_stats if "failures" in payload]
    assert sum(counts["copy_error"] for counts in failures) == len(batch)
    assert all(set(counts) == {"copy_error"} for counts in failures)


def test_a_reset_with_copies_in_flight_succeeds_and_serves_nothing_older(
    engine_factory: Callable[..., VllmSteps], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtier.plugins, "_default_registry", flaky_copy_registry(delay_polls=3))
    engine = engine_factory({"cpu_bytes": 4 * MIB, "copy": {"type": "flaky"}})
    (prompt,) = prompts(11, 1, 64, 65)
    engine.add(prompt)
    engine.step()
    manager = engine.connector.manager
    assert manager.num_inflight_batches > 0, "the stores are meant to be still running"
    # pausing or putting vLLM to sleep raises if the connector's reset answers False
    assert engine.scheduler.reset_connector_cache() is True
    engine.run()
    assert manager.stats().used_blocks == 0
    reset_device_cache(engine)
    engine.generate([prompt])
    assert manager.stats().hit_tokens == 0


def test_reset_empties_the_tier(engine_factory: Callable[..., VllmSteps]) -> None:
    engine = engine_factory()
    batch = prompts(6, 2, 40, 80)
    engine.generate(batch)
    manager = engine.connector.manager
    assert manager.stats().used_blocks > 0
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert manager.stats().used_blocks == 0
    engine.generate(batch)
    assert manager.stats().hit_tokens == 0


def test_lazy_mode_stores_blocks_leaving_the_device(
    engine_factory: Callable[..., VllmSteps],
) -> None:
    engine = engine_factory({"cpu_bytes": 8 * MIB, "store_mode": "lazy"}, num_blocks=40)
    batch = prompts(7, 3, 60, 120)
    cold = engine.generate(batch, max_tokens=2)
    engine.generate(prompts(8, 6, 150, 200), max_tokens=1)
    manager = engine.connector.manager
    assert manager.stats().stored_blocks > 0
    assert engine.generate(batch, max_tokens=2) == cold
    assert manager.stats().hit_tokens > 0
    assert engine.mismatches == []
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.spec.num_blocks - 1, "no block stays protected"


def test_lazy_mode_offers_a_frontier_block_again_only_after_the_tier_lost_blocks(
    engine_factory: Callable[..., VllmSteps], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_factory({"cpu_bytes": 8 * MIB, "store_mode": "lazy"}, num_blocks=40)
    engine.generate(prompts(7, 3, 60, 120), max_tokens=2)
    manager = engine.connector.manager
    offered: list[list[Any]] = []
    memory = manager.planner.frontier
    offer = memory.offer
    monkeypatch.setattr(
        memory, "offer", lambda frontier: offered.append(offer(frontier)) or offered[-1]
    )
    for _ in range(3):
        engine.step()
    assert manager.stats().stored_blocks > 0
    assert offered[-1] == [], "blocks the tier holds were offered again"
    manager.reset()
    engine.step()
    assert offered[-1], "after the tier lost its blocks, the frontier was not offered again"


def test_lazy_mode_reads_the_frontier_again_only_when_vllms_free_queue_changed(
    engine_factory: Callable[..., VllmSteps], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_factory({"cpu_bytes": 8 * MIB, "store_mode": "lazy"}, num_blocks=40)
    engine.generate(prompts(7, 3, 60, 120), max_tokens=2)
    queue = engine.scheduler.kv_cache_manager.block_pool.free_block_queue
    read: list[int] = []
    iter_blocks_after = queue.iter_blocks_after

    def counted(cursor: Any) -> Iterator[Any]:
        for block in iter_blocks_after(cursor):
            read[-1] += 1
            yield block

    monkeypatch.setattr(queue, "iter_blocks_after", counted)

    def step() -> int:
        read.append(0)
        engine.step()
        return read[-1]

    engine.add(prompts(9, 1, BLOCK + 4, BLOCK + 5)[0], max_tokens=8)
    assert step() > 1, "the prompt's blocks came off the free queue: the frontier is read"
    decode = [step() for _ in range(6)]  # inside the prompt's second block: no allocation
    assert decode[-3:] == [1, 1, 1], f"an unchanged frontier was read again: {decode}"
    engine.connector.manager.reset()
    assert step() > 1, "after the tier lost its blocks, the frontier was not read again"


def test_events_name_stored_blocks_with_their_tokens(
    engine_factory: Callable[..., VllmSteps],
) -> None:
    engine = engine_factory(kv_events=True)
    (prompt,) = prompts(9, 1, 3 * BLOCK + 5, 3 * BLOCK + 6)
    engine.generate([prompt])
    stored = [
        event
        for batch in engine.events
        for event in batch.events
        if type(event).__name__ == "BlockStored" and event.medium == "CPU"
    ]
    assert [event.token_ids for event in stored] == [
        prompt[i * BLOCK : (i + 1) * BLOCK] for i in range(3)
    ]
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    assert all(event.group_idx == 0 and event.block_size == BLOCK for event in stored)


def test_events_follow_evicted_blocks_to_the_disk_tier(
    engine_factory: Callable[..., VllmSteps], tmp_path: Path
) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvtier.integrations.checkpoints import TinyLlamaSpec

    record_bytes = TinyLlamaSpec().kv_bytes_per_token() * BLOCK
    disk = {"type": "disk", "path": str(tmp_path), "capacity_bytes": 64 * 2 * record_bytes}
    engine = engine_factory({"cpu_bytes": 4 * record_bytes, "tiers": [disk]}, kv_events=True)
    first, *later = prompts(13, 3, 4 * BLOCK + 3, 4 * BLOCK + 4)
    engine.generate([first])
    engine.generate(later)  # they evict the first prompt's blocks from the host tier
    deadline = time.monotonic() + 10
    events = []
    while time.monotonic() < deadline:
        engine.step()  # hands the evicted blocks to the disk tier, then reports what landed
        events = [event for batch in engine.events for event in batch.events]
        stored = {
            event.block_hashes[0]: event
            for event in events
            if isinstance(event, BlockStored) and event.medium == "STORAGE"
        }
        if len(stored) >= 4:
            break
        time.sleep(0.01)
    host = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    first_hashes = [event.block_hashes[0] for event in host[:4]]
    assert [event.token_ids for event in host[:4]] == [
        first[i * BLOCK : (i + 1) * BLOCK] for i in range(4)
    ]
    removed = {
        event.block_hashes[0]
        for event in events
        if isinstance(event, BlockRemoved) and (event.medium, event.locality) == ("CPU", "LOCAL")
    }
    assert set(first_hashes) <= removed
    for position, block_hash in enumerate(first_hashes):
        event = stored[block_hash]
        assert (event.medium, event.locality, event.ownership) == ("STORAGE", "LOCAL", "disk")
        assert event.token_ids == first[position * BLOCK : (position + 1) * BLOCK]
        assert event.parent_block_hash == (first_hashes[position - 1] if position else None)


def test_steps_that_change_nothing_in_the_tier_report_no_stats(
    engine_factory: Callable[..., VllmSteps], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_factory()
    engine.generate(prompts(11, 2, 40, 80))
    reported = len(engine.connector_stats)
    assert reported > 0
    manager = engine.connector.manager
    built: list[object] = []
    monkeypatch.setattr(manager, "stats", lambda: built.append(1) or type(manager).stats(manager))
    for _ in range(3):
        engine.step()
    assert len(engine.connector_stats) == reported
    assert not built, "a step that changed nothing built the tier's counters"
    assert engine.connector.get_kv_connector_stats() is None
    assert engine.worker.get_kv_connector_stats() is None


def test_metrics_count_what_the_tier_did(engine_factory: Callable[..., VllmSteps]) -> None:
    engine = engine_factory()
    batch = prompts(10, 2, 40, 80)
    engine.generate(batch)
    full_blocks = sum(len(p) // BLOCK for p in batch)
    record = engine.connector.scheduler.record_bytes
    assert engine.counter("stored_blocks") == full_blocks
    assert engine.counter("stored_bytes") == full_blocks * record
    gauges = [stats for stats in engine.connector_stats if "used_blocks" in stats]
    assert gauges[-1]["used_blocks"] == full_blocks
    assert gauges[-1]["capacity_blocks"] == engine.connector.manager.index.num_slots
    assert gauges[-1]["capacity_bytes"] == 4 * MIB
    assert sum(engine.observations("store_batch_blocks")) == full_blocks
    assert len(engine.observations("store_seconds")) == len(
        engine.observations("store_batch_blocks")
    )
    assert engine.observations("request_hit_tokens") == [0, 0]
    reset_device_cache(engine)
    engine.generate(batch)
    assert sum(engine.observations("load_batch_blocks")) == full_blocks
    assert len(engine.observations("load_seconds")) == 2
    assert all(seconds >= 0 for seconds in engine.observations("load_seconds"))
    assert engine.observations("request_hit_tokens")[2:] == [len(p) // BLOCK * BLOCK for p in batch]


def test_a_tenants_blocks_are_sealed_for_its_salt_and_hit_only_with_it(
    engine_factory: Callable[..., VllmSteps], tmp_path: Path
) -> None:
    from kvtier.integrations.checkpoints import TinyLlamaSpec
    from kvtier.tiers.record import MAGIC

    record_bytes = TinyLlamaSpec().kv_bytes_per_token() * BLOCK
    key_file = tmp_path / "tier.key"
    key_file.write_text("5e" * 32 + "\n")
    key_file.chmod(0o600)
    disk = {
        "type": "disk",
        "path": str(tmp_path / "disk"),
        "capacity_bytes": 64 * 2 * record_bytes,
        "key_file": str(key_file),
    }
    engine = engine_factory({"cpu_bytes": 4 * record_bytes, "tiers": [disk]})
    first, *later = prompts(19, 3, 4 * BLOCK + 3, 4 * BLOCK + 4)

    def serve(prompt: list[int], salt: str) -> None:
        engine.add(prompt, cache_salt=salt)
        engine.run()

    for prompt in (first, *later):  # the later prompts evict the first one's blocks to disk
        serve(prompt, "salt-of-tenant-a")
    manager = engine.connector.manager
    deadline = time.monotonic() + 10
    while manager.stats().tiers.get("disk", {}).get("stores", 0) < 4:
        assert time.monotonic() < deadline, "the first prompt's blocks never reached the disk"
        engine.step()
        time.sleep(0.01)
    data = b"".join(path.read_bytes() for path in (tmp_path / "disk").rglob("*.kvtier"))
    headers = [at for at in range(0, len(data), 4096) if data[at : at + 4] == MAGIC]
    assert len(headers) >= 4 and all(data[at + 41] == 1 for at in headers)  # tenant records
    assert b"salt-of-tenant-a" not in data
    for salt, hits in (("salt-of-tenant-b", 0), ("salt-of-tenant-a", 4)):
        reset_device_cache(engine)
        before = manager.stats().promoted_blocks
        serve(first, salt)
        assert manager.stats().promoted_blocks - before == hits
    assert engine.mismatches == []
