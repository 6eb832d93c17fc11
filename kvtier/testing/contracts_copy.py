"""Contract tests for copy backends: point them at your backend's factory.

:class:`CopyBackendContract` checks what every :class:`~kvtier.copy.CopyBackend`
must guarantee, on engine layouts built by
:mod:`kvtier.testing.contracts_layout` (FlashAttention, the vLLM CPU packing,
cross-layer fp8 blocks, Mamba pages): a store writes each block's record
(its bytes from every region, in region order) into its slot and nothing
else; a load writes each slot's record back into its block and nothing else;
any pattern of ids works (runs, permutations, single blocks); handles can be
polled, waited in any order, and report bad batches as
:class:`~kvtier.copy.CopyError`; ``close`` is idempotent.

To run it against your backend, subclass it in a test module and provide a
``backend_factory`` fixture; override ``device`` to run on a GPU::

    import pytest
    from kvtier.testing.contracts_copy import CopyBackendContract

    class TestMyBackend(CopyBackendContract):
        @pytest.fixture
        def device(self):
            return "cuda"

        @pytest.fixture
        def backend_factory(self):
            return lambda layout, host_buffer: MyBackend(MyConfig(), layout, host_buffer)

The host buffer handed to the factory is pinned when ``device`` is a CUDA device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction
from kvtier.layout.base import KVLayout
from kvtier.layout.resolvers import AutoResolver
from kvtier.testing.contracts_layout import (
    LayoutCase,
    cross_layer_case,
    flash_attn_case,
    mamba_case,
    vllm_cpu_packed_case,
)

BackendFactory = Callable[[KVLayout, torch.Tensor], CopyBackend]
"""``factory(layout, host_buffer)`` returning the backend under test."""

POLL_TIMEOUT_S = 30.0
"""How long the polling test waits for ``done`` to turn true."""

CASES: dict[str, Callable[[str], LayoutCase]] = {
    "flash_attn_nhd_fp16": lambda device: flash_attn_case(num_blocks=24, device=device),
    "flash_attn_hnd_bf16": lambda device: flash_attn_case(
        num_blocks=24, order="HND", dtype=torch.bfloat16, device=device
    ),
    "vllm_cpu_block_outer": lambda device: vllm_cpu_packed_case(True, num_blocks=24, device=device),
    "cross_layer_fp8": lambda device: cross_layer_case(
        num_blocks=24, dtype=torch.float8_e4m3fn, device=device
    ),
    "mamba_states": lambda device: mamba_case(num_blocks=24, device=device),
}
"""Engine layouts the contract runs on, by test id."""


@dataclass
class CopyRig:
    """A backend bound to a filled engine layout and a zeroed host buffer."""

    layout: KVLayout
    host: torch.Tensor
    backend: CopyBackend

    @property
    def num_slots(self) -> int:
        return int(self.host.shape[0])

    def record(self, block: int) -> torch.Tensor:
        """What a stored record of ``block`` must hold, on the CPU."""
        return torch.cat([region.view[block].cpu() for region in self.layout.regions])

    def block_rows(self, blocks: Sequence[int]) -> torch.Tensor:
        """The records of ``blocks`` as they are in engine memory now."""
        rows = [self.record(block) for block in blocks]
        if not rows:
            return torch.zeros((0, self.layout.record_bytes), dtype=torch.uint8)
        return torch.stack(rows)

    def run(self, direction: Direction, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Submit one batch and wait for it."""
        self.backend.wait(self.backend.submit(CopyBatch(direction, list(blocks), list(slots))))


def _scramble(layout: KVLayout, generator: torch.Generator) -> None:
    for region in layout.regions:
        values = torch.randint(0, 256, tuple(region.view.shape), generator=generator)
        region.view.copy_(values.to(torch.uint8))


class CopyBackendContract:
    """Tests every copy backend must pass; needs a ``backend_factory`` fixture."""

    @pytest.fixture
    def device(self) -> str:
        return "cpu"

    @pytest.fixture(params=sorted(CASES))
    def rig(
        self, request: pytest.FixtureRequest, device: str, backend_factory: BackendFactory
    ) -> Iterator[CopyRig]:
        case = CASES[request.param](device)
        layout = AutoResolver().resolve(case.kv_caches)
        _scramble(layout, torch.Generator().manual_seed(len(request.param)))
        num_slots = 2 * layout.num_blocks + 3
        host = torch.zeros(
            (num_slots, layout.record_bytes),
            dtype=torch.uint8,
            pin_memory=torch.device(device).type == "cuda",
        )
        backend = backend_factory(layout, host)
        yield CopyRig(layout, host, backend)
        backend.close()

    @pytest.mark.parametrize("pattern", ["runs", "permutation", "reversed", "single"])
    def test_store_writes_each_record_into_its_slot_only(self, rig: CopyRig, pattern: str) -> None:
        blocks, slots = _pattern(pattern, rig.layout.num_blocks, rig.num_slots, seed=1)
        rig.run(Direction.STORE, blocks, slots)
        assert torch.equal(rig.host[slots], rig.block_rows(blocks))
        untouched = sorted(set(range(rig.num_slots)) - set(slots))
        assert not rig.host[untouched].any()

    @pytest.mark.parametrize("pattern", ["runs", "permutation", "reversed", "single"])
    def test_load_writes_each_record_into_its_block_only(self, rig: CopyRig, pattern: str) -> None:
        blocks, slots = _pattern(pattern, rig.layout.num_blocks, rig.num_slots, seed=2)
        generator = torch.Generator().manual_seed(3)
        rig.host.copy_(torch.randint(0, 256, tuple(rig.host.shape), generator=generator))
        before = rig.block_rows(range(rig.layout.num_blocks))
        rig.run(Direction.LOAD, blocks, slots)
        assert torch.equal(rig.block_rows(blocks), rig.host[slots])
        others = sorted(set(range(rig.layout.num_blocks)) - set(blocks))
        assert torch.equal(rig.block_rows(others), before[others])

    def test_round_trip_into_other_blocks(self, rig: CopyRig) -> None:
        num_blocks = rig.layout.num_blocks
        half = num_blocks // 2
        generator = torch.Generator().manual_seed(4)
        sources = torch.randperm(num_blocks, generator=generator)[:half].tolist()
        slots = torch.randperm(rig.num_slots, generator=generator)[:half].tolist()
        expected = rig.block_rows(sources)
        rig.run(Direction.STORE, sources, slots)
        targets = [block for block in range(num_blocks) if block not in sources][:half]
        rig.run(Direction.LOAD, targets, slots)
        assert torch.equal(rig.block_rows(targets), expected)

    def test_store_sees_writes_made_just_before_submit(self, rig: CopyRig) -> None:
        for region in rig.layout.regions:
            region.view[5].fill_(0xA5)
        rig.run(Direction.STORE, [5], [0])
        assert bool((rig.host[0] == 0xA5).all())

    def test_done_turns_true_and_wait_returns(self, rig: CopyRig) -> None:
        handle = rig.backend.submit(CopyBatch(Direction.STORE, [1, 2, 3], [7, 8, 9]))
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while not rig.backend.done(handle):
            assert time.monotonic() < deadline, "done() never turned true"
            time.sleep(0.001)
        rig.backend.wait(handle)
        assert torch.equal(rig.host[[7, 8, 9]], rig.block_rows([1, 2, 3]))

    def test_many_batches_in_flight_waited_in_reverse(self, rig: CopyRig) -> None:
        handles: list[CopyHandle] = []
        for index in range(6):
            blocks = [2 * index, 2 * index + 1]
            handles.append(rig.backend.submit(CopyBatch(Direction.STORE, blocks, blocks)))
        for handle in reversed(handles):
            rig.backend.wait(handle)
        assert torch.equal(rig.host[:12], rig.block_rows(range(12)))

    def test_handle_describes_its_batch(self, rig: CopyRig) -> None:
        handle = rig.backend.submit(CopyBatch(Direction.LOAD, [0, 1], [2, 3]))
        rig.backend.wait(handle)
        assert (handle.direction, handle.num_blocks) == (Direction.LOAD, 2)

    def test_empty_batch_completes(self, rig: CopyRig) -> None:
        handle = rig.backend.submit(CopyBatch(Direction.STORE, [], []))
        rig.backend.wait(handle)
        assert not rig.host.any()

    @pytest.mark.parametrize(
        "direction, blocks, slots",
        [
            (Direction.STORE, [0, -1], [0, 1]),
            (Direction.LOAD, [0, 10_000], [0, 1]),
            (Direction.STORE, [0, 1], [0, 10_000]),
            (Direction.STORE, [0, 1], [4, 4]),
            (Direction.LOAD, [3, 3], [0, 1]),
        ],
        ids=["negative_block", "block_too_big", "slot_too_big", "slot_twice", "block_twice"],
    )
    def test_bad_batch_is_a_copy_error(
        self, rig: CopyRig, direction: Direction, blocks: list[int], slots: list[int]
    ) -> None:
        with pytest.raises(CopyError):
            rig.backend.wait(rig.backend.submit(CopyBatch(direction, blocks, slots)))

    def test_close_is_idempotent_and_later_submits_fail(self, rig: CopyRig) -> None:
        rig.backend.submit(CopyBatch(Direction.STORE, [0], [0]))
        rig.backend.close()
        rig.backend.close()
        assert torch.equal(rig.host[0], rig.record(0))
        with pytest.raises(CopyError):
            rig.backend.submit(CopyBatch(Direction.STORE, [1], [1]))


def _pattern(name: str, num_blocks: int, num_slots: int, seed: int) -> tuple[list[int], list[int]]:
    """Block ids and slots of one id pattern."""
    generator = torch.Generator().manual_seed(seed)
    if name == "runs":
        return list(range(3, 3 + num_blocks // 2)), list(range(5, 5 + num_blocks // 2))
    if name == "permutation":
        blocks = torch.randperm(num_blocks, generator=generator).tolist()
        slots = torch.randperm(num_slots, generator=generator)[:num_blocks].tolist()
        return blocks, slots
    if name == "reversed":
        return list(range(num_blocks))[::-1], list(range(num_blocks))
    if name == "single":
        return [num_blocks - 1], [num_slots - 1]
    raise ValueError(f"unknown id pattern {name!r}")
