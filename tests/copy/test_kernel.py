"""The copy kernel without a GPU: row splitting, table pool, and an NVRTC compile of its source."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.copy.kernel import (
    KERNEL_NAME,
    KERNEL_SOURCE,
    MIN_TABLE_BYTES,
    MappedTablePool,
    split_rows,
)
from kvtier.copy.planner import Segments
from kvtier.cuda.bindings import CudaUnavailable
from kvtier.cuda.nvrtc import compile_cubin
from tests.support.cuda_host_driver import MAPPED_OFFSET, HostDriver


def _segments(*rows: tuple[int, int, int]) -> Segments:
    src, dst, nbytes = (np.array(column, dtype=np.int64) for column in zip(*rows, strict=True))
    return Segments(src, dst, nbytes)


def test_split_rows_cuts_long_segments_into_chunks() -> None:
    rows = split_rows(_segments((1000, 50_000, 100), (2000, 60_000, 32), (0, 16, 64)), 32)
    assert rows.dtype == np.uint64 and rows.flags.c_contiguous
    assert rows.tolist() == [
        [1000, 50_000, 32],
        [1032, 50_032, 32],
        [1064, 50_064, 32],
        [1096, 50_096, 4],
        [2000, 60_000, 32],
        [0, 16, 32],
        [32, 48, 32],
    ]


def test_split_rows_covers_every_byte_exactly_once() -> None:
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 5000, size=200)
    starts = np.cumsum(np.concatenate(([0], sizes[:-1]))) * 2
    rows = split_rows(Segments(starts, starts + 10**9, sizes), 256)
    assert int(rows[:, 2].sum()) == int(sizes.sum())
    assert int(rows[:, 2].max()) <= 256
    assert np.all(rows[:, 1] - rows[:, 0] == 10**9)


def test_split_rows_of_nothing_is_empty() -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert split_rows(Segments(empty, empty, empty), 64).shape == (0, 3)


@pytest.mark.parametrize("chunk_bytes", [0, 24, -16])
def test_split_rows_keeps_chunks_16_byte_aligned(chunk_bytes: int) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        split_rows(_segments((0, 0, 100)), chunk_bytes)


def test_table_pool_reuses_a_table_only_after_its_launch_finished() -> None:
    driver = HostDriver()
    stream = driver.stream_create(0)
    pool = MappedTablePool(driver)
    first = pool.acquire(100)
    assert first.nbytes == MIN_TABLE_BYTES
    assert first.device_address == first.address + MAPPED_OFFSET
    driver.hold(stream)
    pool.release(first, stream)
    second = pool.acquire(100)
    assert second is not first, "the held launch may still read the first table"
    driver.release(stream)
    pool.release(second, stream)
    assert pool.acquire(100) in (first, second)
    bigger = pool.acquire(MIN_TABLE_BYTES + 1)
    assert bigger.nbytes == 2 * MIN_TABLE_BYTES
    pool.close()
    assert driver.live_allocations == 0 and driver.live_events == 0


def test_kernel_source_names_its_entry_point() -> None:
    assert f'extern "C" __global__ void {KERNEL_NAME}(' in KERNEL_SOURCE


@pytest.mark.parametrize("compute_capability", [(8, 0), (9, 0)])
def test_kernel_source_compiles_with_nvrtc(compute_capability: tuple[int, int]) -> None:
    try:
        cubin = compile_cubin(KERNEL_SOURCE, compute_capability)
    except CudaUnavailable as exc:
        pytest.skip(f"NVRTC is not installed here: {exc}")
    assert cubin[:4] == b"\x7fELF"
    assert KERNEL_NAME.encode() in cubin


def test_kernel_moves_16_byte_vectors_with_streaming_hints() -> None:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        _, program = nvrtc.nvrtcCreateProgram(KERNEL_SOURCE.encode(), b"k.cu", 0, [], [])
    except RuntimeError as exc:
        pytest.skip(f"NVRTC is not installed here: {exc}")
    options = [b"--gpu-architecture=compute_90"]
    assert int(nvrtc.nvrtcCompileProgram(program, len(options), options)[0]) == 0
    _, size = nvrtc.nvrtcGetPTXSize(program)
    ptx = b" " * size
    nvrtc.nvrtcGetPTX(program, ptx)
    nvrtc.nvrtcDestroyProgram(program)
    instructions = {line.split()[0] for line in ptx.decode().splitlines() if ".v4." in line}
    assert {"ld.global.cs.v4.u32", "st.global.cs.v4.u32"} <= instructions
