"""The segment planner, checked by executing its segments with host memmove."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.copy.base import CopyBatch, CopyError, Direction
from kvtier.copy.planner import (
    MAX_RUNS,
    RegionGeometry,
    SegmentPlanner,
    Segments,
    batch_arrays,
    batch_runs,
    merge_segments,
)
from kvtier.layout.base import BlockRegion, KVLayout
from kvtier.layout.resolvers import AutoResolver
from kvtier.testing.contracts_layout import (
    block_first_case,
    flash_attn_case,
    mamba_case,
    vllm_cpu_packed_case,
)
from tests.copy.conftest import records


def _execute(segments: Segments) -> None:
    for src, dst, nbytes in segments:
        ctypes.memmove(dst, src, nbytes)


def _fill(layout: KVLayout, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for region in layout.regions:
        values = torch.randint(0, 256, tuple(region.view.shape), generator=generator)
        region.view.copy_(values.to(torch.uint8))


LAYOUTS = {
    "flash_attn_hnd": lambda: flash_attn_case(num_blocks=32, order="HND"),
    "mla": lambda: block_first_case("mla", num_blocks=32, num_layers=2),
    "vllm_cpu_layer_outer": lambda: vllm_cpu_packed_case(False, num_blocks=32),
    "mamba_states": lambda: mamba_case(num_blocks=32),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("direction", list(Direction))
def test_segments_move_exactly_the_batch(name: str, direction: Direction) -> None:
    layout = AutoResolver().resolve(LAYOUTS[name]().kv_caches)
    _fill(layout, seed=1)
    host = torch.randint(0, 256, (48, layout.record_bytes), dtype=torch.uint8)
    rng = np.random.default_rng(2)
    blocks = rng.permutation(32)[:20].tolist()
    slots = rng.permutation(48)[:20].tolist()
    planner = SegmentPlanner.for_tensors(layout, host)
    segments = planner.plan(CopyBatch(direction, blocks, slots))
    assert segments.total_bytes == 20 * layout.record_bytes
    host_before, engine_before = host.clone(), records(layout, list(range(32)))
    _execute(segments)
    if direction is Direction.STORE:
        assert torch.equal(host[slots], engine_before[blocks])
        others = sorted(set(range(48)) - set(slots))
        assert torch.equal(host[others], host_before[others])
    else:
        assert torch.equal(records(layout, blocks), host_before[slots])
        others = sorted(set(range(32)) - set(blocks))
        assert torch.equal(records(layout, others), engine_before[others])


def test_consecutive_blocks_into_consecutive_slots_merge_into_one_segment() -> None:
    engine = torch.zeros((64, 4096), dtype=torch.uint8)
    layout = AutoResolver().resolve({"layer": engine})
    host = torch.zeros((64, 4096), dtype=torch.uint8)
    segments = SegmentPlanner.for_tensors(layout, host).plan(
        CopyBatch(Direction.STORE, list(range(10, 30)), list(range(0, 20)))
    )
    assert len(segments) == 1
    assert (segments.src[0], segments.dst[0], segments.nbytes[0]) == (
        engine[10].data_ptr(),
        host.data_ptr(),
        20 * 4096,
    )


def test_runs_merge_separately_and_regions_do_not_merge_acrossrecords() -> None:
    flash = flash_attn_case(num_blocks=16, num_layers=1)
    layout = AutoResolver().resolve(flash.kv_caches)
    assert len(layout.regions) == 2
    host = torch.zeros((16, layout.record_bytes), dtype=torch.uint8)
    planner = SegmentPlanner.for_tensors(layout, host)
    segments = planner.plan(CopyBatch(Direction.LOAD, [0, 1, 2, 8, 9], [3, 4, 5, 6, 7]))
    # K and V interleave in each host record, so every (pair, region) is its own segment.
    assert len(segments) == 10


def test_single_region_runs_merge() -> None:
    layout = AutoResolver().resolve({"layer": torch.zeros((16, 256), dtype=torch.uint8)})
    host = torch.zeros((16, 256), dtype=torch.uint8)
    planner = SegmentPlanner.for_tensors(layout, host)
    segments = planner.plan(CopyBatch(Direction.LOAD, [0, 1, 2, 8, 9], [3, 4, 5, 6, 7]))
    assert sorted(segments.nbytes.tolist()) == [512, 768]


def test_empty_batch_has_no_segments() -> None:
    layout = AutoResolver().resolve({"layer": torch.zeros((4, 16), dtype=torch.uint8)})
    planner = SegmentPlanner.for_tensors(layout, torch.zeros((4, 16), dtype=torch.uint8))
    segments = planner.plan(CopyBatch(Direction.STORE, [], []))
    assert len(segments) == 0 and segments.total_bytes == 0


def test_plan_from_plain_addresses() -> None:
    planner = SegmentPlanner(
        [RegionGeometry(1000, 100, 40, 0), RegionGeometry(5000, 100, 60, 40)],
        host_address=90_000,
        host_row_bytes=100,
        num_blocks=10,
        num_slots=10,
    )
    segments = planner.plan(CopyBatch(Direction.STORE, [3], [2]))
    assert sorted(segments) == [(1300, 90_200, 40), (5300, 90_240, 60)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"regions": []}, "at least one region"),
        ({"num_slots": 0}, "must be positive"),
        ({"regions": [RegionGeometry(0, 64, 64, 40)]}, "ends at byte 104 of a 100-byte host row"),
    ],
)
def test_planner_rejects_bad_geometry(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {
        "regions": [RegionGeometry(0, 64, 64, 0)],
        "host_address": 0,
        "host_row_bytes": 100,
        "num_blocks": 4,
        "num_slots": 4,
    }
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        SegmentPlanner(**arguments)  # type: ignore[arg-type]


def test_for_tensors_rejects_a_bad_host_buffer() -> None:
    layout = KVLayout((BlockRegion("r", torch.zeros((4, 16), dtype=torch.uint8)),), "block_first")
    with pytest.raises(ValueError, match="uint8"):
        SegmentPlanner.for_tensors(layout, torch.zeros((4, 16), dtype=torch.float32))
    with pytest.raises(ValueError, match="must hold 16 contiguous bytes"):
        SegmentPlanner.for_tensors(layout, torch.zeros((4, 8), dtype=torch.uint8))


@pytest.mark.parametrize(
    "direction, blocks, slots, message",
    [
        (Direction.STORE, [0, 4], [0, 1], "device block 4, outside 0..3"),
        (Direction.STORE, [0, 1], [-1, 1], "host slot -1, outside 0..5"),
        (Direction.STORE, [0, 1], [2, 2], "writes host slot 2 more than once"),
        (Direction.LOAD, [1, 1], [2, 3], "writes device block 1 more than once"),
    ],
)
def test_batch_arrays_rejects_bad_batches(
    direction: Direction, blocks: list[int], slots: list[int], message: str
) -> None:
    with pytest.raises(CopyError, match=message):
        batch_arrays(CopyBatch(direction, blocks, slots), num_blocks=4, num_slots=6)


def test_batch_arrays_allows_one_source_read_twice() -> None:
    blocks, slots = batch_arrays(CopyBatch(Direction.STORE, [1, 1], [2, 3]), 4, 6)
    assert blocks.tolist() == [1, 1] and slots.tolist() == [2, 3]


@pytest.mark.parametrize(
    "direction, blocks, slots, runs",
    [
        (Direction.LOAD, (2, 3, 4), (7, 8, 9), [(2, 7, 3, 1)]),
        (Direction.LOAD, [2, 3, 4], [9, 8, 7], [(2, 9, 3, -1)]),
        (Direction.LOAD, (4, 3, 2), (7, 8, 9), [(2, 9, 3, -1)]),
        (Direction.LOAD, (4, 3, 2), (9, 8, 7), [(2, 7, 3, 1)]),
        (Direction.LOAD, np.arange(0, 4), np.arange(5, 1, -1), [(0, 5, 4, -1)]),
        (Direction.LOAD, (3,), (0,), [(3, 0, 1, 1)]),
        (Direction.LOAD, (), (), []),
        # vLLM's freed blocks come back in reverse order, then fresh ones
        (Direction.LOAD, (5, 4, 3, 0, 1), (1, 2, 3, 4, 5), [(3, 3, 3, -1), (0, 4, 2, 1)]),
        (Direction.STORE, (1, 3, 5), (0, 1, 2), [(1, 0, 1, 1), (3, 1, 1, 1), (5, 2, 1, 1)]),
        (Direction.STORE, (0, 1, 2), (9, 10, 11), None),  # slot 11 is out of range
        (Direction.STORE, (2, 3), (-1, 0), None),
        (Direction.LOAD, (7, 8), (0, 1), None),  # block 8 is out of range
        (Direction.STORE, (2, 3, 4), (7, 8, 8), None),  # slot 8 written twice
        (Direction.STORE, (0, 1, 5, 6), (3, 4, 4, 5), None),  # across runs
        (Direction.LOAD, (0, 1, 0), (3, 4, 5), None),
        (Direction.STORE, (0, 1, 0), (3, 4, 5), [(0, 3, 2, 1), (0, 5, 1, 1)]),  # reads twice
    ],
)
def test_batch_runs_finds_a_few_runs_in_range_or_nothing(
    direction: Direction, blocks: object, slots: object, runs: list[tuple[int, ...]] | None
) -> None:
    batch = CopyBatch(direction, blocks, slots)  # type: ignore[arg-type]
    assert batch_runs(batch, num_blocks=8, num_slots=11) == runs


def test_batch_runs_leaves_a_batch_of_many_runs_to_the_arrays() -> None:
    blocks = list(range(0, 2 * MAX_RUNS, 2))
    batch = CopyBatch(Direction.STORE, blocks, list(range(MAX_RUNS)))
    assert batch_runs(batch, 64, 64) == [(block, k, 1, 1) for k, block in enumerate(blocks)]
    more = CopyBatch(Direction.STORE, [*blocks, 40], list(range(MAX_RUNS + 1)))
    assert batch_runs(more, 64, 64) is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 5)),
        min_size=1,
        max_size=30,
    )
)
def test_merge_keeps_every_byte_mapping(triples: list[tuple[int, int, int]]) -> None:
    src = np.array([10 * a for a, _, _ in triples], dtype=np.int64)
    dst = np.array([10 * b for _, b, _ in triples], dtype=np.int64)
    nbytes = np.array([n for _, _, n in triples], dtype=np.int64)
    merged = merge_segments(src, dst, nbytes)

    def mapping(s: np.ndarray, d: np.ndarray, n: np.ndarray) -> set[tuple[int, int]]:
        return {
            (int(a) + k, int(b) + k) for a, b, c in zip(s, d, n, strict=True) for k in range(int(c))
        }

    assert mapping(merged.src, merged.dst, merged.nbytes) == mapping(src, dst, nbytes)
    assert merged.total_bytes == int(nbytes.sum())
    assert len(merged) <= len(triples)


def test_thousands_of_random_blocks_give_one_segment_per_block_and_region() -> None:
    layout = AutoResolver().resolve(
        flash_attn_case(num_blocks=4096, num_layers=4, block_tokens=1).kv_caches
    )
    host = torch.zeros((4096, layout.record_bytes), dtype=torch.uint8)
    planner = SegmentPlanner.for_tensors(layout, host)
    blocks = np.random.default_rng(0).permutation(4096)
    segments = planner.plan_arrays(Direction.STORE, blocks, np.arange(4096))
    assert len(segments) == 8 * 4096
    assert segments.total_bytes == 4096 * layout.record_bytes
