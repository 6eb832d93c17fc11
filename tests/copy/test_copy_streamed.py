"""The dma, kernel and auto backends on the host-memory CUDA driver: bytes, ordering, bookkeeping.

Every CUDA call goes through :class:`~tests.support.cuda_host_driver.HostDriver`,
which copies with ``memmove`` and completes events when their stream drains,
so the planner's addresses, the worker thread, the stream/event ordering and
the failure paths are all checked without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier.copy.auto import AutoCopyConfig, AutoExecutor, build_auto_backend
from kvtier.copy.base import CopyBatch, CopyError, CopyHandle, Direction
from kvtier.copy.dma import DmaCopyConfig, DmaExecutor, build_dma_backend
from kvtier.copy.kernel import KernelCopyConfig, KernelExecutor, build_kernel_backend
from kvtier.copy.streamed import SegmentExecutor, StreamCopyBackend
from kvtier.cuda.bindings import CudaUnavailable
from kvtier.cuda.pinning import PinnedRegion, PinningError, pin_host_buffer
from kvtier.layout.base import BlockRegion, KVLayout
from tests.support.cuda_host_driver import HostDriver

NUM_BLOCKS = 24
NUM_SLOTS = 20


def _layout(kind: str) -> tuple[KVLayout, list[torch.Tensor]]:
    """A CPU layout plus the tensors behind it, filled with random bytes."""
    generator = torch.Generator().manual_seed(7)
    if kind == "flash_attn":  # per layer (2, nb, block bytes): K and V regions, contiguous rows
        tensors = [torch.empty(2, NUM_BLOCKS, 96, dtype=torch.uint8) for _ in range(2)]
        regions = [
            BlockRegion(f"layer{i}.{half}", tensor[h])
            for i, tensor in enumerate(tensors)
            for h, half in enumerate("kv")
        ]
    elif kind == "block_first":  # one (nb, layers, bytes) tensor: strided rows per layer
        tensors = [torch.empty(NUM_BLOCKS, 3, 80, dtype=torch.uint8)]
        regions = [BlockRegion(f"layer{i}", tensors[0][:, i]) for i in range(3)]
    else:  # one region of odd-sized blocks: nothing 16-byte aligned
        tensors = [torch.empty(NUM_BLOCKS * 37 + 5, dtype=torch.uint8)]
        regions = [BlockRegion("odd", tensors[0][5:].view(NUM_BLOCKS, 37))]
    for tensor in tensors:
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=generator))
    return KVLayout(tuple(regions), kind), tensors


LAYOUTS = ("flash_attn", "block_first", "odd")

EXECUTORS: dict[str, Callable[[], SegmentExecutor]] = {
    "dma": lambda: DmaExecutor(DmaCopyConfig()),
    "dma_per_segment": lambda: DmaExecutor(DmaCopyConfig(batched=False)),
    "kernel": lambda: KernelExecutor(KernelCopyConfig(chunk_bytes=64, threads_per_block=32)),
    "auto": lambda: AutoExecutor(AutoCopyConfig(kernel_below_bytes=200)),
}


class Rig:
    """A backend on the host driver, with its layout, tensors and pinned host buffer."""

    def __init__(
        self, executor: str, layout_kind: str = "flash_attn", driver: HostDriver | None = None
    ) -> None:
        self.driver = driver or HostDriver()
        self.layout, self.tensors = _layout(layout_kind)
        self.host = torch.zeros(NUM_SLOTS, self.layout.record_bytes, dtype=torch.uint8)
        pinned = pin_host_buffer(self.host, chunk_bytes=2 << 20, driver=self.driver)
        assert pinned is not None
        self.pinned: PinnedRegion = pinned
        self.executor = EXECUTORS[executor]()
        self.backend = StreamCopyBackend(self.layout, self.host, self.executor, driver=self.driver)

    def block(self, block: int) -> bytes:
        return b"".join(bytes(region.view[block].numpy()) for region in self.layout.regions)

    def slot(self, slot: int) -> bytes:
        return bytes(self.host[slot].numpy())

    def run(self, direction: Direction, blocks: list[int], slots: list[int]) -> None:
        self.backend.wait(self.backend.submit(CopyBatch(direction, blocks, slots)))

    def close(self) -> None:
        self.backend.close()
        self.pinned.close()


@pytest.fixture(params=list(EXECUTORS))
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    rig = Rig(request.param)
    yield rig
    rig.close()


@pytest.mark.parametrize("executor", list(EXECUTORS))
@pytest.mark.parametrize("layout_kind", LAYOUTS)
def test_store_then_load_round_trips_bytes(executor: str, layout_kind: str) -> None:
    rig = Rig(executor, layout_kind)
    # runs of consecutive blocks into consecutive slots (merged) and scattered pairs
    blocks = [3, 4, 5, 6, 11, 0, 23, 9]
    slots = [10, 11, 12, 13, 2, 19, 0, 5]
    before = {block: rig.block(block) for block in blocks}
    rig.run(Direction.STORE, blocks, slots)
    for block, slot in zip(blocks, slots, strict=True):
        assert rig.slot(slot) == before[block]
    targets = [1, 2, 7, 8, 12, 13, 14, 15]
    untouched = rig.block(16)
    rig.run(Direction.LOAD, targets, slots)
    for block, target in zip(blocks, targets, strict=True):
        assert rig.block(target) == before[block]
    assert rig.block(16) == untouched
    rig.close()
    assert rig.driver.live_events == 0
    assert rig.driver.live_streams == 0
    assert rig.driver.live_allocations == 0


def test_store_waits_for_the_compute_stream(rig: Rig) -> None:
    """The model's pending write to a block must land in the host slot, not the stale bytes."""
    driver = rig.driver
    fresh = torch.full((rig.layout.regions[0].bytes_per_block,), 0xAB, dtype=torch.uint8)
    driver.hold(driver.compute_stream)
    driver.enqueue(driver.compute_stream, lambda: rig.layout.regions[0].view[2].copy_(fresh))
    handle = rig.backend.submit(CopyBatch(Direction.STORE, [2], [4]))
    assert not rig.backend.done(handle)
    driver.release(driver.compute_stream)
    rig.backend.wait(handle)
    assert rig.slot(4)[: fresh.numel()] == bytes(fresh.numpy())


def test_load_waits_for_the_compute_stream(rig: Rig) -> None:
    """Work queued before a load (reading the old block) runs before the load overwrites it."""
    driver = rig.driver
    rig.run(Direction.STORE, [0], [0])
    seen: list[bytes] = []
    old = rig.block(5)
    driver.hold(driver.compute_stream)
    driver.enqueue(driver.compute_stream, lambda: seen.append(rig.block(5)))
    handle = rig.backend.submit(CopyBatch(Direction.LOAD, [5], [0]))
    driver.release(driver.compute_stream)
    rig.backend.wait(handle)
    assert seen == [old]
    assert rig.block(5) == rig.block(0)


def test_done_is_false_until_the_copy_stream_drains(rig: Rig) -> None:
    store_stream = rig.backend.streams[Direction.STORE]
    rig.driver.hold(store_stream)
    handle = rig.backend.submit(CopyBatch(Direction.STORE, [1, 2], [3, 4]))
    for _ in range(3):
        assert not rig.backend.done(handle)
    rig.driver.release(store_stream)
    while not rig.backend.done(handle):
        pass
    assert rig.slot(3) == rig.block(1)
    assert rig.backend.done(handle), "a finished handle stays done"
    rig.backend.wait(handle)


def test_stores_and_loads_use_separate_low_priority_streams(rig: Rig) -> None:
    streams = rig.backend.streams
    assert streams[Direction.STORE] != streams[Direction.LOAD]
    for stream in streams.values():
        assert rig.driver.priority_of(stream) == rig.driver.lowest_stream_priority()
    rig.run(Direction.STORE, [0], [0])
    rig.run(Direction.LOAD, [1], [0])
    waits = rig.driver.calls_named("stream_wait_event")
    assert [call[1] for call in waits] == [streams[Direction.STORE], streams[Direction.LOAD]]


def test_copies_are_issued_from_the_worker_thread() -> None:
    threads: list[str] = []

    class Recording(HostDriver):
        def event_record(self, event: int, stream: int) -> None:
            if stream != self.compute_stream:
                threads.append(threading.current_thread().name)
            super().event_record(event, stream)

    rig = Rig("dma", driver=Recording())
    rig.run(Direction.STORE, [0, 1], [0, 1])
    rig.close()
    assert threads == ["kvtier-dma-copy"]


def test_a_failed_batch_raises_copy_error_and_the_next_one_works() -> None:
    rig = Rig("dma")
    rig.driver.fail_on("memcpy_batch", message="CUDA_ERROR_ILLEGAL_ADDRESS")
    failed = rig.backend.submit(CopyBatch(Direction.STORE, [0], [0]))
    with pytest.raises(CopyError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        rig.backend.wait(failed)
    rig.backend.wait(failed)  # the failure was reported once; the handle is spent
    rig.run(Direction.STORE, [1], [1])
    assert rig.slot(1) == rig.block(1)
    rig.close()
    assert rig.driver.live_events == 0


def test_a_failure_to_record_the_ready_event_surfaces_in_done() -> None:
    rig = Rig("kernel")
    rig.driver.fail_on("event_record", message="CUDA_ERROR_LAUNCH_FAILED")
    handle = rig.backend.submit(CopyBatch(Direction.LOAD, [0], [0]))
    with pytest.raises(CopyError, match="CUDA_ERROR_LAUNCH_FAILED"):
        rig.backend.done(handle)
    rig.close()
    assert rig.driver.live_events == 0


def test_an_invalid_batch_is_rejected_at_submit(rig: Rig) -> None:
    with pytest.raises(CopyError, match="outside"):
        rig.backend.submit(CopyBatch(Direction.STORE, [NUM_BLOCKS], [0]))
    with pytest.raises(CopyError, match="more than once"):
        rig.backend.submit(CopyBatch(Direction.STORE, [0, 1], [3, 3]))


def test_a_handle_from_elsewhere_is_refused(rig: Rig) -> None:
    with pytest.raises(ValueError, match="not issued by this backend"):
        rig.backend.done(CopyHandle(5, Direction.STORE, 1))


def test_an_empty_batch_completes(rig: Rig) -> None:
    rig.run(Direction.LOAD, [], [])


def test_close_waits_for_in_flight_batches_and_is_idempotent() -> None:
    rig = Rig("kernel")
    store_stream = rig.backend.streams[Direction.STORE]
    rig.driver.hold(store_stream)
    rig.backend.submit(CopyBatch(Direction.STORE, [7], [7]))
    threading.Timer(0.05, rig.driver.release, (store_stream,)).start()
    rig.backend.close()
    assert rig.slot(7) == rig.block(7)
    rig.backend.close()
    with pytest.raises(CopyError, match="closed"):
        rig.backend.submit(CopyBatch(Direction.STORE, [0], [0]))
    rig.pinned.close()
    assert rig.driver.live_events == 0 and rig.driver.live_streams == 0


def test_concurrent_stores_and_loads_from_two_threads(rig: Rig) -> None:
    expected = {block: rig.block(block) for block in range(NUM_BLOCKS)}
    rig.run(Direction.STORE, list(range(10)), list(range(10)))
    errors: list[BaseException] = []

    def stores() -> None:
        try:
            for block in range(10, 20):
                rig.run(Direction.STORE, [block], [block])
        except BaseException as exc:  # reported to the main thread below
            errors.append(exc)

    def loads() -> None:
        try:
            for slot in range(10):
                rig.run(Direction.LOAD, [20 + slot % 4], [slot])
                assert rig.block(20 + slot % 4) == expected[slot]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stores), threading.Thread(target=loads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for block in range(10, 20):
        assert rig.slot(block) == expected[block]


def test_dma_issues_one_batched_call_per_batch() -> None:
    rig = Rig("dma", "odd")
    rig.run(Direction.STORE, [0, 1, 2, 3], [4, 5, 6, 7])
    rig.run(Direction.STORE, [9, 12], [0, 1])
    calls = rig.driver.calls_named("memcpy_batch")
    # one region: consecutive blocks into consecutive slots merge into one segment
    assert [call[1] for call in calls] == [1, 2]
    assert rig.driver.calls_named("memcpy_async") == []
    rig.close()


def test_dma_copies_per_segment_when_the_driver_lacks_batching(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig("dma", driver=HostDriver(memcpy_batch=False))
    assert "cuMemcpyBatchAsync" in caplog.text
    rig.run(Direction.STORE, [0, 1, 5], [0, 1, 2])
    assert len(rig.driver.calls_named("memcpy_async")) == 4 * 3  # regions x blocks
    assert rig.slot(2) == rig.block(5)
    rig.close()


def test_kernel_launches_once_per_batch_and_reuses_its_table() -> None:
    rig = Rig("kernel")
    rig.run(Direction.STORE, [0, 1, 2], [0, 1, 2])
    rig.run(Direction.LOAD, [5, 6], [0, 1])
    launches = rig.driver.calls_named("launch_kernel")
    assert len(launches) == 2
    _, name, grid, block, (table, rows), _ = launches[0]
    # four regions of 96-byte blocks (records interleave them, so nothing merges): each
    # segment is cut into a 64-byte and a 32-byte row
    assert (name, grid, block, rows) == ("kvtier_copy_segments", (24, 1, 1), (32, 1, 1), 24)
    assert len(rig.driver.calls_named("host_alloc_mapped")) == 1
    assert len(rig.driver.calls_named("load_kernel")) == 1
    rig.close()


def test_kernel_needs_a_pinned_mapped_host_buffer() -> None:
    driver = HostDriver()
    layout, _ = _layout("flash_attn")
    host = torch.zeros(NUM_SLOTS, layout.record_bytes, dtype=torch.uint8)
    executor = KernelExecutor(KernelCopyConfig())
    with pytest.raises(PinningError, match="pin_host_buffer"):
        StreamCopyBackend(layout, host, executor, driver=driver)
    assert driver.live_streams == 0


def test_auto_picks_the_kernel_for_small_segments_and_dma_for_large() -> None:
    rig = Rig("auto", "odd")
    executor = rig.executor
    assert isinstance(executor, AutoExecutor)
    rig.run(Direction.STORE, [0, 5, 9], [0, 1, 2])  # three 37-byte segments: below 200 bytes
    rig.run(Direction.STORE, list(range(10, 18)), list(range(3, 11)))  # one of 296 bytes
    assert executor.choices == {"kernel": 1, "dma": 1}
    assert len(rig.driver.calls_named("launch_kernel")) == 1
    assert len(rig.driver.calls_named("memcpy_batch")) == 1
    assert rig.slot(10) == rig.block(17)
    rig.close()


def test_auto_falls_back_to_dma_when_the_kernel_is_unusable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver = HostDriver()
    layout, _ = _layout("flash_attn")
    host = torch.zeros(NUM_SLOTS, layout.record_bytes, dtype=torch.uint8)
    executor = AutoExecutor(AutoCopyConfig(kernel_below_bytes=1 << 20))
    backend = StreamCopyBackend(layout, host, executor, driver=driver)
    assert "dma only" in caplog.text
    backend.wait(backend.submit(CopyBatch(Direction.STORE, [0, 3], [0, 1])))
    assert executor.choices == {"dma": 1}
    assert bytes(host[1].numpy()) == b"".join(bytes(r.view[3].numpy()) for r in layout.regions)
    backend.close()


@pytest.mark.parametrize(
    ("build", "config"),
    [
        (build_dma_backend, DmaCopyConfig()),
        (build_kernel_backend, KernelCopyConfig()),
        (build_auto_backend, AutoCopyConfig()),
    ],
)
def test_factories_on_a_cpu_layout_say_they_need_cuda(build: Callable, config: object) -> None:
    layout, _ = _layout("flash_attn")
    host = torch.zeros(NUM_SLOTS, layout.record_bytes, dtype=torch.uint8)
    with pytest.raises(CudaUnavailable, match=r"copy backend needs CUDA: .* on cpu"):
        build(config, layout, host)
