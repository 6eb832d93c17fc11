"""KV-cache events of every tier, through vLLM's own ZMQ publisher, as a router receives them.

One real engine on CPU with a small host tier above a disk tier and a Redis
tier publishes its events on a random endpoint; a subscriber in the test
decodes vLLM's msgpack batches the way a cache-aware router does, and follows a
prompt's blocks from the host tier down to this host's disk and the fleet's
Redis, and out of the disk tier when it fills up.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.integrations.checkpoints import TinyLlamaSpec
from kvtier.tiers.disk import SUPERBLOCK_BYTES, DiskTier
from tests.integrations.vllm.conftest import BLOCK, random_prompts, start_engine

pytest.importorskip("vllm")
zmq = pytest.importorskip("zmq")

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engine_environment")]

RECORD_BYTES = TinyLlamaSpec().kv_bytes_per_token() * BLOCK
PROMPT_BLOCKS = 6
PROMPTS = random_prompts(random.Random(3), 6, PROMPT_BLOCKS * BLOCK + 5, PROMPT_BLOCKS * BLOCK + 6)
"""Six prompts of six full blocks: 36 blocks, over four times what the host tier holds."""
DISK_RECORDS = 16
"""The disk tier holds 16 blocks: the last prompts' demotions push the first prompt's out."""


class Router:
    """A subscriber to vLLM's KV-event stream, keeping where each block is, as a router does."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []
        self.sequence: list[int] = []

    def receive(self, quiet_s: float = 1.0) -> None:
        """Decode every batch that arrives until none has for ``quiet_s`` seconds."""
        while self.socket.poll(int(quiet_s * 1000)):
            _topic, sequence, payload = self.socket.recv_multipart()
            self.sequence.append(int.from_bytes(sequence, "big"))
            self.events.extend(self.decoder.decode(payload).events)

    def stored(self, place: tuple[str, str, str | None]) -> dict[Any, Any]:
        """Blocks stored in one place (medium, locality, ownership), by block hash."""
        return {
            event.block_hashes[0]: event
            for event in self.events
            if type(event).__name__ == "BlockStored" and self.place(event) == place
        }

    def removed(self, place: tuple[str, str, str | None]) -> set[Any]:
        return {
            block_hash
            for event in self.events
            if type(event).__name__ == "BlockRemoved" and self.place(event) == place
            for block_hash in event.block_hashes
        }

    @staticmethod
    def place(event: Any) -> tuple[str, str, str | None]:  # noqa: ANN401
        return event.medium, event.locality, event.ownership

    def close(self) -> None:
        self.socket.close(linger=0)


HOST = ("CPU", "LOCAL", None)
DISK = ("STORAGE", "LOCAL", "disk")
REDIS = ("STORAGE", "REMOTE", "redis")


def test_a_router_sees_a_prefix_move_from_host_memory_to_disk_and_redis(
    model_dir: str,
    tmp_path: Path,
    tiering_redis: Any,  # noqa: ANN401
) -> None:
    from vllm.config import KVEventsConfig

    from kvtier.integrations.vllm.offline import generate, settle, shutdown

    tiering_redis.client().flushall()
    endpoint = f"ipc://{tmp_path / 'kv-events'}"
    disk = {
        "type": "disk",
        "path": str(tmp_path / "disk"),
        "capacity_bytes": SUPERBLOCK_BYTES + DISK_RECORDS * DiskTier.slot_bytes_for(RECORD_BYTES),
    }
    redis = {"type": "redis", "url": tiering_redis.url, "timeout_s": 2.0}
    llm = start_engine(
        model_dir,
        {"cpu_bytes": 8 * RECORD_BYTES, "tiers": [disk, redis]},
        num_device_blocks=64,
        max_model_len=512,
        max_num_seqs=4,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint
        ),
    )
    router = Router(endpoint)
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        for prompt in PROMPTS:
            generate(llm, [prompt], max_tokens=2)
            settle(llm)
        deadline = time.monotonic() + 30
        while len(router.removed(DISK)) < PROMPT_BLOCKS and time.monotonic() < deadline:
            generate(llm, [[1, 2, 3]], max_tokens=1)  # steps that report the last writes
            router.receive(quiet_s=0.2)
        router.receive()
    finally:
        shutdown(llm)
        router.close()

    assert router.sequence == sorted(router.sequence)
    first = PROMPTS[0]
    chunks = [first[i * BLOCK : (i + 1) * BLOCK] for i in range(PROMPT_BLOCKS)]
    host, on_disk, in_redis = router.stored(HOST), router.stored(DISK), router.stored(REDIS)
    hashes = [next(h for h, e in host.items() if e.token_ids == chunk) for chunk in chunks]
    for place, stored in (("disk", on_disk), ("redis", in_redis)):
        for position, block_hash in enumerate(hashes):
            assert block_hash in stored, f"block {position} of the prompt never reached {place}"
            event = stored[block_hash]
            assert event.token_ids == chunks[position]
            assert event.parent_block_hash == (hashes[position - 1] if position else None)
            assert event.block_size == BLOCK
    assert set(hashes) <= router.removed(HOST), "a block reaches the lower tiers when evicted"
    assert set(hashes) <= router.removed(DISK), "the disk tier made room for later prompts"
    assert not router.removed(REDIS), "Redis evicts without telling: no removal is invented"


@pytest.mark.parametrize(
    ("endpoint", "connects"),
    [
        ("tcp://*:5557", False),
        ("tcp://[::]:5557", False),
        ("ipc:///tmp/kv-events", False),
        ("tcp://127.0.0.1:5557", True),
        ("tcp://0.0.0.0:5557", True),
        ("tcp://router.internal:5557", True),
    ],
)
def test_an_endpoint_with_a_host_warns_that_vllm_connects_to_it(
    endpoint: str, connects: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's publisher connects to a tcp:// address with a host; a subscriber that connects
    too hears nothing, so kvtier says so at start-up."""
    from vllm.config import KVEventsConfig

    from kvtier.integrations.vllm.scheduler import warn_if_publisher_connects

    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm.scheduler"):
        warn_if_publisher_connects(SimpleNamespace(kv_events_config=events))  # type: ignore[arg-type]
    warned = [
        record.getMessage()
        for record in caplog.records
        if record.name == "kvtier.integrations.vllm.scheduler"
    ]
    if connects:
        assert warned == [
            f"KV events: vLLM's publisher connects to {endpoint} (an address with a host) "
            "instead of binding it, so the subscriber must bind that address; for the engine "
            "to bind, use a wildcard host such as tcp://*:<port>"
        ]
    else:
        assert warned == []
