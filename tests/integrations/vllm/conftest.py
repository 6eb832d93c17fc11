"""What the vLLM tests share: in-process engines started the same way, a random-weight model,
the offload manager behind an engine, vLLM config objects built without an engine, and kvtier
storage tiers to run below vLLM's own CPU tier."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama

BLOCK = 32
MIB = 1 << 20


ENGINE_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
}
"""In-process engines (a few seconds each instead of half a minute), and CPU attention that
rounds a request the same way whatever else shares its step.

vLLM's CPU attention splits long sequences' KV across threads by default, and how it
splits depends on the whole batch and on the thread count. A request's logits then round
differently when its neighbours change, and bfloat16 greedy tokens flip at ties. kvtier
changes which requests share a step (a tier hit skips most of a prefill, a load delays a
request), so outputs with and without it are only comparable token for token with the
split off; with it off they do not depend on the machine's core count either."""


@pytest.fixture(scope="module")
def engine_environment() -> Iterator[None]:
    """:data:`ENGINE_ENVIRONMENT` for a whole module: modules that start engines with
    :func:`start_engine` name it in ``pytest.mark.usefixtures``."""
    saved = {k: os.environ.get(k) for k in ENGINE_ENVIRONMENT}
    os.environ.update(ENGINE_ENVIRONMENT)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random-weight Llama of the default shape; modules that need another define their own."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), TinyLlamaSpec()))


def start_engine(model_dir: str, kvtier: dict | None, **kwargs: object) -> Any:  # noqa: ANN401
    """An in-process ``vllm.LLM``, with kvtier configured as ``kvtier`` (``None``: without it).

    The cost guard is off unless ``kvtier`` turns it on: its decisions follow measured copy,
    read and prefill times, which swing with the machine's load, and these tests count hits.
    """
    from vllm import LLM, envs
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    # vLLM keeps one worker connector per process: a live engine's would serve the new one.
    assert not has_kv_transfer_group(), "an earlier engine in this process was not shut down"
    # vLLM freezes its environment when an engine starts; one started before the
    # engine_environment fixture would have frozen the split on.
    assert not envs.VLLM_CPU_ATTN_SPLIT_KV, "vLLM's CPU attention still splits KV across threads"

    from kvtier.integrations.vllm.offline import engine_kwargs

    if kvtier is not None:
        kvtier = {"cost_guard": False, **kvtier}
    return LLM(**engine_kwargs(model_dir, kvtier=kvtier, **kwargs))


def manager_of(llm: Any) -> Any:  # noqa: ANN401
    """The scheduler connector's offload manager of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.manager


def random_prompts(rng: random.Random, count: int, low: int, high: int) -> list[list[int]]:
    """``count`` prompts of random tokens, each ``low`` to ``high - 1`` tokens long."""
    return [[rng.randrange(1000) for _ in range(rng.randrange(low, high))] for _ in range(count)]


class Registered:
    """Metric classes bound to a private registry, as vLLM's factory passes them."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.types = {kind: self._bound(kind) for kind in (Counter, Gauge, Histogram)}

    def _bound(self, kind: type) -> type:
        registry = self.registry

        class Bound(kind):  # type: ignore[misc, valid-type]
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound


def vllm_config(kvtier: dict[str, object] | None = None, world_size: int = 1) -> Any:  # noqa: ANN401
    """A ``VllmConfig`` on CPU, with kvtier as its connector configured as ``kvtier``."""
    from vllm.config import DeviceConfig, KVTransferConfig, ParallelConfig, VllmConfig

    transfer = None
    if kvtier is not None:
        transfer = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=kvtier,
        )
    config = VllmConfig(device_config=DeviceConfig("cpu"), kv_transfer_config=transfer)
    config.parallel_config = ParallelConfig(tensor_parallel_size=world_size)
    return config


DISK_CAPACITY_BYTES = 64 * 8192
"""Room for 64 of the test engine's chunks, with their headers."""


@pytest.fixture(scope="session")
def tiering_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real ``redis-server`` for the session."""
    pytest.importorskip("redis")
    from tests.support.redis_server import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("tiering-redis")).start()
    yield server
    server.stop()


@pytest.fixture(params=["disk", "redis"])
def kvtier_tier(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """A kvtier storage-tier config: the disk tier in a fresh directory, or an emptied Redis."""
    if request.param == "disk":
        return {
            "type": "disk",
            "path": str(tmp_path / "disk-tier"),
            "capacity_bytes": DISK_CAPACITY_BYTES,
        }
    server = request.getfixturevalue("tiering_redis")
    server.client().flushall()
    return {"type": "redis", "url": server.url, "timeout_s": 2.0}


@pytest.fixture
def tiering_engine() -> Iterator[Callable[..., Any]]:
    """Build :class:`~tests.support.vllm_tiering.TieringEngine` s; each is closed at the end."""
    from tests.support.vllm_tiering import TieringEngine

    engines: list[TieringEngine] = []

    def build(*secondary_tiers: dict[str, Any], **options: Any) -> TieringEngine:
        engine = TieringEngine(secondary_tiers, **options)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


@pytest.fixture
def damage_record(request: pytest.FixtureRequest) -> Callable[[dict[str, Any], bytes], None]:
    """Flip one byte of the stored record whose payload is the given bytes, in the store itself."""

    def damage(tier: dict[str, Any], payload: bytes) -> None:
        if tier["type"] == "disk":
            for path in Path(tier["path"]).rglob("*.kvtier"):
                data = bytearray(path.read_bytes())
                at = data.find(payload)
                if at >= 0:
                    data[at + len(payload) // 2] ^= 0x01
                    path.write_bytes(bytes(data))
                    return
        else:
            client = request.getfixturevalue("tiering_redis").client()
            for name in client.scan_iter():
                data = bytearray(client.get(name))
                at = data.find(payload)
                if at >= 0:
                    data[at + len(payload) // 2] ^= 0x01
                    client.set(name, bytes(data))
                    return
        raise AssertionError(f"no record of the {tier['type']} tier holds that payload")

    return damage
