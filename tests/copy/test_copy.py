"""The torch copy backend: the copy contract on CPU (and CUDA when present), and its own rules."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvtier.copy.base import CopyBatch, CopyError, CopyHandle, Direction
from kvtier.copy.cpu_rows import (
    RowCopier,
    choose_plan,
    openmp_threads_sleep,
    pair_runs,
    run_starts,
    sort_ids,
)
from kvtier.copy.planner import MAX_RUNS, batch_arrays
from kvtier.copy.torch_backend import TorchCopyBackend, TorchCopyConfig
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import KVLayout
from kvtier.layout.resolvers import AutoResolver, PerLayerResolver
from kvtier.plugins import build_plugin_manager, collect
from kvtier.testing.contracts_copy import BackendFactory, CopyBackendContract
from kvtier.testing.contracts_layout import flash_attn_case, vllm_cpu_packed_case
from tests.copy.conftest import records


def _torch_factory(layout: KVLayout, host_buffer: torch.Tensor) -> TorchCopyBackend:
    return TorchCopyBackend(TorchCopyConfig(), layout, host_buffer)


class TestTorchBackendOnCpu(CopyBackendContract):
    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return _torch_factory


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestTorchBackendOnCuda(CopyBackendContract):
    @pytest.fixture
    def device(self) -> str:
        return "cuda"

    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return lambda layout, host: TorchCopyBackend(
            TorchCopyConfig(cuda_staging_bytes=3 * layout.record_bytes), layout, host
        )


def _layout(num_blocks: int = 64, **kwargs: object) -> KVLayout:
    case = flash_attn_case(num_blocks=num_blocks, **kwargs)  # type: ignore[arg-type]
    layout = PerLayerResolver("flash_attn").resolve(case.kv_caches)
    for index, region in enumerate(layout.regions):
        region.view.copy_(torch.randint(0, 256, tuple(region.view.shape)).to(torch.uint8))
        region.view[:, 0] = index
    return layout


def _small_batches_use_the_pool(monkeypatch: pytest.MonkeyPatch, *, torch_runs: bool) -> None:
    """Cut every batch over the copy pool; with ``torch_runs``, copy runs by torch at any size."""
    monkeypatch.setattr("kvtier.copy.cpu_rows.PARALLEL_MIN_BYTES", 0)
    if torch_runs:
        monkeypatch.setattr("kvtier.copy.cpu_rows.TORCH_RUN_MIN_BYTES", 0)


def _store_then_load(
    backend: TorchCopyBackend, host: torch.Tensor, blocks: Sequence[int], slots: Sequence[int]
) -> None:
    """Store ``blocks`` into ``slots``, check the host rows, clear the engine, load them back,
    check the blocks; then close the backend."""
    layout = backend.layout
    expected = records(layout, list(blocks))
    backend.wait(backend.submit(CopyBatch(Direction.STORE, blocks, slots)))
    assert torch.equal(host[list(slots)], expected)
    for region in layout.regions:
        region.view.zero_()
    backend.wait(backend.submit(CopyBatch(Direction.LOAD, blocks, slots)))
    assert torch.equal(records(layout, list(blocks)), expected)
    backend.close()


RANDOM_BLOCKS = np.random.default_rng(0).permutation(1024)[:256]
RANDOM_SLOTS = np.random.default_rng(1).permutation(2048)[:256]


@pytest.mark.parametrize("torch_runs", [False, True], ids=["numpy_runs", "torch_runs"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    "one_region, blocks, slots, plan",
    [
        (True, np.arange(100, 356), np.arange(256), "runs"),
        (False, np.arange(100, 356), np.arange(256), "runs"),
        (False, np.arange(355, 99, -1), np.arange(256), "runs"),
        (True, np.arange(100, 356), np.arange(255, -1, -1), "runs"),
        (False, np.r_[100:228, 500:628], np.arange(256), "runs"),
        (False, np.arange(100, 356), np.r_[127:-1:-1, 255:127:-1], "runs"),
        (True, RANDOM_BLOCKS, np.arange(256), "gather"),
        (False, RANDOM_BLOCKS, np.arange(256), "staged"),
        (True, np.arange(100, 356), RANDOM_SLOTS, "scatter"),
        (False, np.arange(100, 356), RANDOM_SLOTS, "scatter"),
        (True, RANDOM_BLOCKS, RANDOM_SLOTS, "staged"),
        (False, RANDOM_BLOCKS, RANDOM_SLOTS, "staged"),
    ],
    ids=[
        "one_region-block_run_to_slot_run",
        "regions-block_run_to_slot_run",
        "regions-block_run_backwards_to_slot_run",
        "one_region-block_run_to_slot_run_backwards",
        "regions-two_block_runs_to_slot_run",
        "regions-block_run_to_two_slot_runs_backwards",
        "one_region-random_blocks_to_slot_run",
        "regions-random_blocks_to_slot_run",
        "one_region-block_run_to_random_slots",
        "regions-block_run_to_random_slots",
        "one_region-random_to_random",
        "regions-random_to_random",
    ],
)
def test_each_cpu_plan_is_chosen_and_copies_correctly(
    one_region: bool,
    blocks: np.ndarray,
    slots: np.ndarray,
    plan: str,
    threads: int,
    torch_runs: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _small_batches_use_the_pool(monkeypatch, torch_runs=torch_runs)
    if one_region:
        engine = torch.randint(0, 256, (1024, 512), dtype=torch.uint8)
        layout = PerLayerResolver("block_first").resolve({"layer": engine})
    else:
        layout = _layout(num_blocks=1024, num_layers=2, block_tokens=4)
    host = torch.zeros((2048, layout.record_bytes), dtype=torch.uint8)
    backend = TorchCopyBackend(TorchCopyConfig(cpu_threads=threads), layout, host)
    by_slot = sort_ids(slots)
    runs_of_pairs = len(pair_runs(by_slot.ids, blocks[by_slot.order]))
    runs = len(by_slot.runs), len(sort_ids(blocks).runs)
    row_bytes = layout.record_bytes // len(layout.regions)
    assert (
        choose_plan(len(blocks), runs_of_pairs, *runs, contiguous=one_region, row_bytes=row_bytes)
        == plan
    )
    _store_then_load(backend, host, blocks.tolist(), slots.tolist())


@pytest.mark.parametrize(
    "slots, reversed_max_row_bytes, cut",
    [
        (np.arange(64), 0, False),
        (np.arange(63, -1, -1), 1024, False),
        (np.arange(63, -1, -1), 512, True),
    ],
    ids=["slots_count_up-torch", "slots_count_down-torch", "slots_count_down_wide_rows-pool"],
)
def test_a_batch_of_torch_runs_is_not_cut_over_the_pool(
    slots: np.ndarray, reversed_max_row_bytes: int, cut: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvtier.copy.cpu_rows.PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr("kvtier.copy.cpu_rows.TORCH_RUN_MIN_BYTES", 16 << 10)
    monkeypatch.setattr("kvtier.copy.cpu_rows.TORCH_REVERSED_MAX_ROW_BYTES", reversed_max_row_bytes)
    engine = torch.randint(0, 256, (128, 1024), dtype=torch.uint8)
    host = torch.zeros((64, 2048), dtype=torch.uint8)[:, 1024:]
    copier = RowCopier([(engine, host)], threads=2)
    handed: list[object] = []
    submit = copier._pool.submit  # type: ignore[union-attr]
    monkeypatch.setattr(copier._pool, "submit", lambda *a: handed.append(a) or submit(*a))
    blocks = np.arange(32, 96)
    copier.copy(Direction.STORE, blocks, slots)
    assert torch.equal(host[torch.from_numpy(slots)], engine[32:96])
    assert bool(handed) == cut
    # a batch of runs below the torch size is cut as before
    monkeypatch.setattr("kvtier.copy.cpu_rows.TORCH_RUN_MIN_BYTES", 128 << 10)
    handed.clear()
    copier.copy(Direction.LOAD, blocks, np.arange(64))
    assert handed
    copier.close()


@pytest.mark.parametrize(
    "environ, asleep",
    [
        ({}, False),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, False),
        ({"OMP_WAIT_POLICY": " passive "}, True),
        ({"GOMP_SPINCOUNT": "0"}, True),
        ({"GOMP_SPINCOUNT": "300000"}, False),
        ({"KMP_BLOCKTIME": "0"}, True),
        ({"KMP_BLOCKTIME": "5"}, False),
    ],
)
def test_openmp_settings_that_put_threads_to_sleep_are_recognised(
    environ: dict[str, str], asleep: bool
) -> None:
    assert openmp_threads_sleep(environ) is asleep


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_where_torchs_threads_sleep_large_runs_go_through_numpy(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of large runs that torch would copy on the caller's thread is cut over the
    pool like any numpy batch, and a copier of one thread copies a run that counts down
    without ``index_select``."""
    monkeypatch.setattr("kvtier.copy.cpu_rows.PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr("kvtier.copy.cpu_rows.TORCH_RUN_MIN_BYTES", 16 << 10)
    if how == "environment":
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    options = {"torch_runs": False} if how == "argument" else {}
    engine = torch.randint(0, 256, (128, 1024), dtype=torch.uint8)
    host = torch.zeros((64, 2048), dtype=torch.uint8)[:, 1024:]
    copier = RowCopier([(engine, host)], threads=2, **options)
    handed: list[object] = []
    submit = copier._pool.submit  # type: ignore[union-attr]
    monkeypatch.setattr(copier._pool, "submit", lambda *a: handed.append(a) or submit(*a))
    copier.copy(Direction.STORE, np.arange(32, 96), np.arange(64))
    assert torch.equal(host, engine[32:96])
    assert handed
    copier.close()

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("index_select was called")

    monkeypatch.setattr(torch, "index_select", refused)
    alone = RowCopier([(engine, host)], threads=1, **options)
    alone.copy_runs(Direction.LOAD, [(0, 63, 64, -1)])
    assert torch.equal(engine[:64], host.flip(0))
    alone.close()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("torch_runs", [False, True], ids=["numpy_runs", "torch_runs"])
@pytest.mark.parametrize(
    "blocks, slots",
    [
        (range(40, 104), range(3, 67)),
        (range(40, 104), range(66, 2, -1)),
        ([40], [3]),
        ([*range(50, 40, -1), *range(70, 80), *range(100, 90, -1)], range(30)),
        ([*range(40, 50), *range(90, 100)], [*range(50, 40, -1), *range(70, 60, -1)]),
    ],
    ids=["slots_count_up", "slots_count_down", "one_block", "three_runs", "two_runs_down"],
)
def test_a_batch_of_a_few_runs_is_copied_without_id_arrays(
    blocks: range | list[int],
    slots: range | list[int],
    torch_runs: bool,
    threads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _small_batches_use_the_pool(monkeypatch, torch_runs=torch_runs)
    layout = _layout(num_blocks=128, num_layers=2, block_tokens=4)
    host = torch.zeros((80, layout.record_bytes), dtype=torch.uint8)
    backend = TorchCopyBackend(TorchCopyConfig(cpu_threads=threads), layout, host)

    def refuse(*_: object) -> None:
        raise AssertionError("a few runs need no id arrays")

    monkeypatch.setattr("kvtier.copy.torch_backend.batch_arrays", refuse)
    _store_then_load(backend, host, tuple(blocks), tuple(slots))


def test_a_fragmented_batch_goes_run_by_run_while_that_is_estimated_cheaper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = _layout(num_blocks=128, num_layers=2, block_tokens=4)
    host = torch.zeros((80, layout.record_bytes), dtype=torch.uint8)
    backend = TorchCopyBackend(TorchCopyConfig(), layout, host)
    copier = backend._rows
    assert copier is not None
    limit = copier.max_runs(32)
    assert MAX_RUNS < limit < 32, "32 rows in a few regions: more runs than the floor, not all"
    assert copier.max_runs(256) > limit, "planning from id arrays costs the same for more rows"
    rows = torch.zeros((8, 64), dtype=torch.uint8)
    many = RowCopier([(rows, rows.clone()) for _ in range(160)], threads=1)
    assert many.max_runs(32) == MAX_RUNS, "a call per run in each of many regions costs more"
    arrays = batch_arrays
    used: list[int] = []

    def counted(batch: CopyBatch, *limits: int) -> object:
        used.append(len(batch))
        return arrays(batch, *limits)

    monkeypatch.setattr("kvtier.copy.torch_backend.batch_arrays", counted)
    # runs of two blocks each, as many runs as the limit for 32 rows
    blocks = [block for first in range(0, 4 * limit, 4) for block in (first, first + 1)]
    _store_then_load(backend, host, tuple(blocks), tuple(range(len(blocks))))
    assert used == [], "a batch within the limit was planned from id arrays"
    blocks = list(range(0, 2 * (limit + 8), 2))  # runs of one block each
    assert copier.max_runs(len(blocks)) < len(blocks)
    backend = TorchCopyBackend(TorchCopyConfig(), layout, host)
    _store_then_load(backend, host, tuple(blocks), tuple(range(len(blocks))))
    assert used == [len(blocks), len(blocks)], "a store and a load past the limit"


def test_the_plan_of_least_estimated_cost_is_chosen() -> None:
    # a few runs: a slice each
    assert choose_plan(256, 20, 20, 20, contiguous=True, row_bytes=4096) == "runs"
    # many pairs, few runs on one side: np.take into destination runs, else fancy assignment
    assert choose_plan(256, 256, 20, 20, contiguous=True, row_bytes=4096) == "gather"
    assert choose_plan(256, 256, 20, 20, contiguous=False, row_bytes=4096) == "scatter"
    # a load of 32 scattered blocks from consecutive slots: one assignment, not a slice per row
    assert choose_plan(32, 32, 32, 1, contiguous=False, row_bytes=16 << 10) == "scatter"
    # a store of scattered blocks into consecutive slots: a slice per row from 16 KiB up...
    assert choose_plan(32, 32, 1, 32, contiguous=False, row_bytes=16 << 10) == "runs"
    assert choose_plan(256, 256, 256, 256, contiguous=False, row_bytes=256 << 10) == "runs"
    # ...and through staging for small rows
    assert choose_plan(32, 32, 1, 32, contiguous=False, row_bytes=2048) == "staged"
    assert choose_plan(256, 256, 200, 200, contiguous=False, row_bytes=4096) == "staged"


def test_pair_runs_follow_the_source_up_or_down_one_row_at_a_time() -> None:
    dst = np.array([1, 2, 3, 4, 8, 9, 10, 11, 12])
    assert run_starts(dst).tolist() == [0, 4]
    assert pair_runs(dst, np.array([5, 6, 7, 8, 9, 10, 11, 12, 13])) == [(0, 4, 1), (4, 9, 1)]
    assert pair_runs(dst, np.array([9, 8, 7, 6, 3, 2, 1, 0, 7])) == [
        (0, 4, -1),
        (4, 8, -1),
        (8, 9, 1),
    ]
    # a turn starts a new run; so does a jump on either side
    assert pair_runs(dst, np.array([5, 6, 5, 4, 0, 1, 3, 4, 5])) == [
        (0, 2, 1),
        (2, 4, -1),
        (4, 6, 1),
        (6, 9, 1),
    ]
    assert pair_runs(np.array([3]), np.array([7])) == [(0, 1, 1)]
    assert pair_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize(
    "ids, runs",
    [
        (np.array([5, 3, 4, 2]), [2]),
        (np.array([1, 2, 3, 7, 8]), [1, 7]),
        (np.array([9, 1, 2, 5]), [1, 5, 9]),
        (np.array([4]), [4]),
    ],
    ids=["permutation_of_a_range", "already_sorted", "unsorted", "single"],
)
def test_sort_ids(ids: np.ndarray, runs: list[int]) -> None:
    result = sort_ids(ids)
    assert result.ids.tolist() == sorted(ids.tolist())
    assert ids[result.order].tolist() == sorted(ids.tolist())
    assert result.ids[result.runs].tolist() == runs


def test_strided_regions_and_host_columns() -> None:
    layout = AutoResolver().resolve(vllm_cpu_packed_case(False, num_blocks=40).kv_caches)
    assert len(layout.regions) == 4
    host = torch.zeros((50, layout.record_bytes), dtype=torch.uint8)
    backend = TorchCopyBackend(TorchCopyConfig(), layout, host)
    for region in layout.regions:
        region.view.copy_(torch.randint(0, 256, tuple(region.view.shape)).to(torch.uint8))
    blocks = list(range(39, -1, -1))
    backend.wait(backend.submit(CopyBatch(Direction.STORE, blocks, list(range(5, 45)))))
    assert torch.equal(host[5:45], records(layout, blocks))


def test_cpu_submit_returns_a_finished_handle() -> None:
    layout = _layout()
    backend = TorchCopyBackend(
        TorchCopyConfig(), layout, torch.zeros((8, layout.record_bytes), dtype=torch.uint8)
    )
    handle = backend.submit(CopyBatch(Direction.STORE, [1], [2]))
    assert backend.done(handle)
    assert backend.done(handle)


def test_a_handle_from_elsewhere_is_rejected() -> None:
    layout = _layout()
    backend = TorchCopyBackend(
        TorchCopyConfig(), layout, torch.zeros((8, layout.record_bytes), dtype=torch.uint8)
    )
    with pytest.raises(ValueError, match="not issued by this backend"):
        backend.done(CopyHandle(3, Direction.STORE, 1))


@pytest.mark.parametrize(
    "host, message",
    [
        (torch.zeros((8, 5), dtype=torch.uint8), r"contiguous \[num_slots, \d+\]"),
        (torch.zeros((8, 4), dtype=torch.int32), "uint8"),
        (torch.zeros(8, dtype=torch.uint8), "uint8 tensor"),
    ],
)
def test_bad_host_buffers_are_rejected(host: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TorchCopyBackend(TorchCopyConfig(), _layout(), host)


def test_non_contiguous_host_buffer_is_rejected() -> None:
    layout = _layout()
    host = torch.zeros((8, 2 * layout.record_bytes), dtype=torch.uint8)[:, : layout.record_bytes]
    with pytest.raises(ValueError, match="contiguous"):
        TorchCopyBackend(TorchCopyConfig(), layout, host)


def test_registered_as_torch() -> None:
    registry = collect(build_plugin_manager(env={"KVTIER_LOAD_PLUGINS": ""}))
    layout = _layout()
    host = torch.zeros((8, layout.record_bytes), dtype=torch.uint8)
    config = registry.get(COPY_BACKEND, "torch").config_model()
    backend = registry.build(COPY_BACKEND, config, layout, host)
    assert isinstance(backend, TorchCopyBackend)


def test_config_rejects_non_positive_sizes() -> None:
    with pytest.raises(ValueError, match="cuda_staging_bytes"):
        TorchCopyConfig(cuda_staging_bytes=0)
    with pytest.raises(ValueError, match="cpu_threads"):
        TorchCopyConfig(cpu_threads=0)


def test_submit_after_close_names_the_backend() -> None:
    layout = _layout()
    backend = TorchCopyBackend(
        TorchCopyConfig(), layout, torch.zeros((8, layout.record_bytes), dtype=torch.uint8)
    )
    backend.close()
    with pytest.raises(CopyError, match="closed"):
        backend.submit(CopyBatch(Direction.STORE, [0], [0]))


def test_cuda_staging_bytes_takes_units() -> None:
    assert TorchCopyConfig(cuda_staging_bytes="64MiB").cuda_staging_bytes == 64 << 20


@pytest.mark.parametrize("direction", list(Direction))
def test_cuda_chunk_arithmetic_on_cpu_tensors(direction: Direction) -> None:
    """The CUDA path's per-chunk copies are plain torch ops; run them on CPU tensors."""
    layout = AutoResolver().resolve(vllm_cpu_packed_case(False, num_blocks=16).kv_caches)
    host = torch.randint(0, 256, (20, layout.record_bytes), dtype=torch.uint8)
    backend = TorchCopyBackend(TorchCopyConfig(), layout, host)
    for region in layout.regions:
        region.view.copy_(torch.randint(0, 256, tuple(region.view.shape)).to(torch.uint8))
    blocks, slots = [9, 2, 14, 3, 0], [1, 2, 3, 10, 11]
    engine_before, host_before = records(layout, blocks), host[slots].clone()
    backend._copy_chunk_cuda(direction, torch.tensor(blocks), np.array(slots))
    if direction is Direction.STORE:
        assert torch.equal(host[slots], engine_before)
    else:
        assert torch.equal(records(layout, blocks), host_before)
