"""The dma, kernel and auto backends on a real CUDA device (marked ``cuda``, skipped without one).

The copy-backend contract suite, byte-exact round trips through every
synthetic engine layout, stores and loads in flight together, and the two
orderings that silently corrupt data when missing: a store must wait for the
compute that writes its blocks, and a load must not report done before its
bytes arrived.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.config import PluginConfig
from kvtier.copy.auto import AutoCopyConfig
from kvtier.copy.base import CopyBackend, CopyBatch, Direction
from kvtier.copy.dma import DmaCopyConfig
from kvtier.copy.kernel import KernelCopyConfig
from kvtier.cuda.pinning import PinnedRegion, pin_host_buffer
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import BlockRegion, KVLayout
from kvtier.plugins import default_registry
from kvtier.testing.contracts_copy import BackendFactory, CopyBackendContract

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIGS: dict[str, PluginConfig] = {
    "dma": DmaCopyConfig(),
    "dma_per_segment": DmaCopyConfig(batched=False),
    "kernel": KernelCopyConfig(),
    "auto": AutoCopyConfig(),
}

SPIN_CYCLES = 200_000_000
"""GPU clock cycles the compute stream spins before writing (about 0.1 s on current GPUs)."""


class Tier:
    """A pinned host buffer and a backend built through the registry."""

    def __init__(self, name: str, layout: KVLayout, num_slots: int) -> None:
        self.host = torch.zeros(num_slots, layout.record_bytes, dtype=torch.uint8)
        region = pin_host_buffer(self.host)
        assert region is not None, "pinning must work on a CUDA machine"
        self.pinned: PinnedRegion = region
        config = CONFIGS[name]
        self.backend: CopyBackend = default_registry().build(
            COPY_BACKEND, config, layout, self.host
        )

    def run(self, direction: Direction, blocks: list[int], slots: list[int]) -> None:
        self.backend.wait(self.backend.submit(CopyBatch(direction, blocks, slots)))

    def close(self) -> None:
        self.backend.close()
        self.pinned.close()


@pytest.fixture
def plain_layout() -> KVLayout:
    """One region of 64 KiB blocks, as a cross-layer cache would have."""
    tensor = torch.zeros(32, 64 << 10, dtype=torch.uint8, device="cuda")
    return KVLayout((BlockRegion("blocks", tensor),), "plain")


@pytest.fixture(params=list(CONFIGS))
def tier(request: pytest.FixtureRequest, plain_layout: KVLayout) -> Iterator[Tier]:
    tier = Tier(request.param, plain_layout, num_slots=16)
    yield tier
    tier.close()


def _layout_names() -> list[str]:
    from tests.support.engine import LAYOUTS

    return list(LAYOUTS)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layout_name", _layout_names())
def test_round_trip_is_byte_exact(name: str, layout_name: str) -> None:
    from tests.support.engine import EngineSpec, SyntheticEngine

    spec = EngineSpec(
        layout=layout_name,
        num_blocks=48,
        block_tokens=16,
        num_kv_heads=4,
        head_dim=64,
        device="cuda",
    )
    engine = SyntheticEngine(spec)
    tier = Tier(name, engine.layout, num_slots=40)
    keys = [f"block-{index}".encode() for index in range(20)]
    blocks = [0, 1, 2, 3, 4, 5, 6, 7, 10, 12, 14, 16, 30, 31, 32, 33, 40, 41, 42, 47]
    slots = [0, 1, 2, 3, 4, 5, 6, 7, 39, 20, 21, 8, 9, 10, 11, 12, 13, 30, 31, 25]
    for block, key in zip(blocks, keys, strict=True):
        engine.compute(block, key)
    tier.run(Direction.STORE, blocks, slots)
    for block in blocks:
        engine.scramble(block)
    targets = [(block + 1) % 48 for block in blocks]
    tier.run(Direction.LOAD, targets, slots)
    torch.cuda.synchronize()
    for target, key in zip(targets, keys, strict=True):
        assert engine.mismatches(target, key) == [], f"block {target} after the round trip"
    tier.close()


def test_store_and_load_in_flight_together(tier: Tier, plain_layout: KVLayout) -> None:
    view = plain_layout.regions[0].view
    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, device="cuda"))
    tier.host.copy_(torch.randint(0, 256, tier.host.shape, dtype=torch.uint8))
    expected_host = tier.host[8:16].clone()
    expected_blocks = view[0:8].cpu()
    store = tier.backend.submit(CopyBatch(Direction.STORE, list(range(8)), list(range(8))))
    load = tier.backend.submit(CopyBatch(Direction.LOAD, list(range(16, 24)), list(range(8, 16))))
    tier.backend.wait(load)
    tier.backend.wait(store)
    assert torch.equal(tier.host[0:8], expected_blocks)
    assert torch.equal(view[16:24].cpu(), expected_host)


def test_store_waits_for_the_compute_stream(tier: Tier, plain_layout: KVLayout) -> None:
    """Fails if a store reads its blocks before the kernel queued to write them ran."""
    view = plain_layout.regions[0].view
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    view[3].fill_(0x5A)
    handle = tier.backend.submit(CopyBatch(Direction.STORE, [3], [0]))
    tier.backend.wait(handle)
    assert bool((tier.host[0] == 0x5A).all()), "the store copied the block before it was written"


def test_a_load_is_not_done_before_its_bytes_arrived(tier: Tier, plain_layout: KVLayout) -> None:
    view = plain_layout.regions[0].view
    tier.host[5].fill_(0xC3)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    handle = tier.backend.submit(CopyBatch(Direction.LOAD, [9], [5]))
    assert not tier.backend.done(handle), "done before the queued compute even finished"
    tier.backend.wait(handle)
    assert bool((view[9] == 0xC3).all())


@pytest.mark.parametrize(
    "config", [DmaCopyConfig(), KernelCopyConfig(), AutoCopyConfig()], ids=["dma", "kernel", "auto"]
)
class TestContractOnCuda(CopyBackendContract):
    @pytest.fixture
    def device(self) -> str:
        return "cuda"

    @pytest.fixture
    def backend_factory(self, config: PluginConfig) -> BackendFactory:
        return lambda layout, host: default_registry().build(COPY_BACKEND, config, layout, host)
