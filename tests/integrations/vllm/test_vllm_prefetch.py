"""Prefetch at arrival in vLLM: a queued request's blocks are read from a disk tier while it
waits, an aborted request's prefetch is cancelled, and outputs stay vanilla vLLM's.

The first two tests run vLLM's real scheduler and both connector halves without a model
(:class:`~tests.support.vllm_steps.VllmSteps`, every loaded block checked byte for byte);
the last one runs real engines with a random-weight Llama, with and without kvtier.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.checkpoints import TinyLlamaSpec  # noqa: E402
from tests.integrations.vllm.conftest import BLOCK, manager_of, start_engine  # noqa: E402
from tests.support.vllm_steps import StepsSpec, VllmSteps, write_model_config  # noqa: E402

pytestmark = pytest.mark.vllm

STEPS_BLOCK = 16
STEPS_RECORD = TinyLlamaSpec().kv_bytes_per_token() * STEPS_BLOCK
PROMPT_BLOCKS = 4


def prompts(seed: int, count: int, blocks: int, block: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(blocks * block + 3)] for _ in range(count)]


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("tiny-llama-config"))


@pytest.fixture
def disk_engine(config_dir: Path, tmp_path: Path) -> Iterator[Callable[..., VllmSteps]]:
    """Model-free engines over one disk tier, one at a time, with a host tier of 16 blocks."""
    engines: list[VllmSteps] = []
    disk = {"type": "disk", "path": str(tmp_path), "capacity_bytes": 64 * STEPS_RECORD}

    def build(**spec: Any) -> VllmSteps:
        config = {"cpu_bytes": 16 * STEPS_RECORD, "tiers": [disk]}
        engine = VllmSteps(config_dir, config, StepsSpec(**spec))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


def fill_disk(build: Callable[..., VllmSteps], batch: list[list[int]]) -> list[list[int]]:
    """Serve ``batch`` on a first engine, whose graceful close writes its host tier to disk."""
    first = build()
    expected = first.generate(batch, max_tokens=2)
    first.close()
    return expected


def test_a_queued_request_is_read_from_disk_before_vllm_schedules_it(
    disk_engine: Callable[..., VllmSteps],
) -> None:
    from vllm.v1.request import RequestStatus

    running, queued = prompts(21, 2, PROMPT_BLOCKS, STEPS_BLOCK)
    expected = fill_disk(disk_engine, [queued])
    engine = disk_engine(max_num_seqs=1)
    engine.add(running, max_tokens=12)  # a new prompt: it keeps the only seat for a while
    request_id = engine.add(queued, max_tokens=2)
    request = engine.scheduler.requests[request_id]
    manager = engine.connector.manager
    keys = manager.namespace.keys(request.block_hashes[:PROMPT_BLOCKS])
    deadline = time.monotonic() + 20
    while manager.index.lookup(keys) < PROMPT_BLOCKS:
        assert time.monotonic() < deadline, "the queued request's blocks were never read"
        engine.step()
        time.sleep(0.005)
    assert request.status == RequestStatus.WAITING, "read while it waited, not once scheduled"
    engine.run()
    assert engine.outputs[request_id] == expected[0]
    assert engine.mismatches == []
    stats = manager.stats()
    assert stats.prefetched_used_blocks == stats.prefetched_blocks == PROMPT_BLOCKS
    # both were probed at arrival; the running one's probe found nothing, so only the
    # queued one's blocks were read, once
    disk = dict(stats.tiers["disk"])
    assert disk.pop("read_buffer_bytes") > 0
    assert disk == {"hits": PROMPT_BLOCKS, "bytes_read": PROMPT_BLOCKS * STEPS_RECORD}
    assert engine.counter("prefetches_started") == engine.counter("prefetches_completed") == 2
    covered = engine.observations("prefetch_covered_seconds")
    assert len(covered) == 2 and max(covered) > 0


def test_an_aborted_request_cancels_its_prefetch_and_leaves_no_slot_reserved(
    disk_engine: Callable[..., VllmSteps],
) -> None:
    from vllm.v1.request import RequestStatus

    running, aborted = prompts(22, 2, PROMPT_BLOCKS, STEPS_BLOCK)
    fill_disk(disk_engine, [aborted])
    engine = disk_engine(max_num_seqs=1)
    first = engine.scheduler.requests[engine.add(running, max_tokens=6)]
    deadline = time.monotonic() + 20
    while first.status != RequestStatus.RUNNING:  # its own prefetch (a miss) ends first
        assert time.monotonic() < deadline
        engine.step()
        time.sleep(0.005)
    request_id = engine.add(aborted, max_tokens=2)
    engine.step()  # the plan carries its reads
    assert request_id in engine.connector.manager.moves.prefetches.waiting
    engine.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
    manager = engine.connector.manager
    assert manager.moves.prefetches.reserved == 0
    engine.run()
    deadline = time.monotonic() + 10
    while not manager.settled:  # the reads already planned land as ordinary blocks
        assert time.monotonic() < deadline
        engine.step()
        time.sleep(0.005)
    stats = manager.stats()
    assert (stats.prefetches_started, stats.prefetches_cancelled) == (2, 1)
    index = manager.index.stats()
    assert (index.pinned, index.writing) == (0, 0)
    assert manager.num_requests == 0 and engine.connector.scheduler.session.requests == {}


@pytest.mark.usefixtures("engine_environment")
def test_outputs_with_prefetch_from_disk_equal_vanilla_vllms(
    model_dir: str, tmp_path: Path
) -> None:
    """Twelve prompts of six blocks, twice, at once (four run, the rest queue), on a device
    cache of 64 blocks: the second round finds most blocks only on disk."""
    from kvtier.integrations.vllm.offline import generate, settle, shutdown

    record_bytes = TinyLlamaSpec().kv_bytes_per_token() * BLOCK
    disk = {"type": "disk", "path": str(tmp_path), "capacity_bytes": 256 * record_bytes}
    batch = prompts(23, 12, 6, BLOCK)
    device = {"num_device_blocks": 64, "max_model_len": 512, "max_num_seqs": 4}
    outputs = []
    for kvtier in (None, {"cpu_bytes": 12 * record_bytes, "tiers": [disk]}):
        llm = start_engine(model_dir, kvtier, **device)
        try:
            got = generate(llm, batch, max_tokens=4)
            settle(llm)
            got += generate(llm, batch, max_tokens=4)
            stats = manager_of(llm).stats() if kvtier is not None else None
        finally:
            shutdown(llm)
        outputs.append(got)
    assert outputs[1] == outputs[0]
    assert stats is not None and stats.prefetches_started > 0
    assert stats.tiers["disk"].get("hits", 0) > 0 and stats.prefetched_used_blocks > 0, repr(
        stats
    ).replace("...", "")
