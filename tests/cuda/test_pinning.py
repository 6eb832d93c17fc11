"""Tests for pinning the host buffer: chunk arithmetic, registration, rollback, fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.cuda.pinning import (
    CHUNK_ALIGN_BYTES,
    Chunk,
    PinningError,
    mapped_offset,
    pin_host_buffer,
    plan_chunks,
)
from tests.support.cuda_host_driver import MAPPED_OFFSET, HostDriver

MiB = 1 << 20

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_plan_chunks_covers_the_range_on_chunk_boundaries() -> None:
    chunk = 4 * MiB
    start = 3 * chunk - 123
    chunks = plan_chunks(start, 9 * MiB, chunk)
    assert chunks[0] == Chunk(start, 123)
    assert [c.nbytes for c in chunks] == [123, chunk, chunk, 9 * MiB - 123 - 2 * chunk]
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert before.address + before.nbytes == after.address
        assert after.address % chunk == 0
    assert sum(c.nbytes for c in chunks) == 9 * MiB


def test_plan_chunks_one_chunk_when_the_range_fits() -> None:
    assert plan_chunks(8 * MiB, MiB, 4 * MiB) == [Chunk(8 * MiB, MiB)]


@pytest.mark.parametrize("chunk_bytes", [0, -CHUNK_ALIGN_BYTES, CHUNK_ALIGN_BYTES + 4096])
def test_plan_chunks_rejects_unaligned_chunk_sizes(chunk_bytes: int) -> None:
    with pytest.raises(ValueError, match="multiple of"):
        plan_chunks(0, MiB, chunk_bytes)


def test_plan_chunks_rejects_an_empty_range() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        plan_chunks(4096, 0, CHUNK_ALIGN_BYTES)


def test_pin_registers_every_chunk_and_close_unregisters_them() -> None:
    driver = HostDriver()
    buffer = torch.empty(5 * MiB, dtype=torch.uint8)
    region = pin_host_buffer(buffer, chunk_bytes=2 * MiB, driver=driver)
    assert region is not None
    expected = plan_chunks(buffer.data_ptr(), buffer.numel(), 2 * MiB)
    assert driver.registered == {c.address: c.nbytes for c in expected}
    assert region.nbytes == buffer.numel()
    assert region.device_pointer() == buffer.data_ptr() + MAPPED_OFFSET
    region.close()
    region.close()
    assert driver.registered == {}
    assert len(driver.calls_named("host_unregister")) == len(expected)
    assert not driver.closed, "a driver passed in belongs to the caller"
    with pytest.raises(PinningError, match="closed"):
        region.device_pointer()


def test_pin_is_a_context_manager() -> None:
    driver = HostDriver()
    buffer = torch.empty(MiB, dtype=torch.uint8)
    with pin_host_buffer(buffer, chunk_bytes=2 * MiB, driver=driver) as region:
        assert region.buffer is buffer
        assert driver.registered
    assert driver.registered == {}


def test_failed_registration_rolls_back_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    driver = HostDriver()
    driver.fail_on("host_register", after=2, message="CUDA_ERROR_OUT_OF_MEMORY")
    buffer = torch.empty(9 * MiB, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="kvtier.cuda.pinning"):
        region = pin_host_buffer(buffer, chunk_bytes=2 * MiB, driver=driver)
    assert region is None
    assert driver.registered == {}
    assert len(driver.calls_named("host_unregister")) == 2
    assert "stays unpinned" in caplog.text and "CUDA_ERROR_OUT_OF_MEMORY" in caplog.text
    assert "chunk 3 of" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without CUDA")
def test_pin_without_cuda_warns_and_returns_none(caplog: pytest.LogCaptureFixture) -> None:
    buffer = torch.empty(MiB, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="kvtier.cuda.pinning"):
        assert pin_host_buffer(buffer) is None
    assert "needs CUDA" in caplog.text


def test_pin_rejects_non_contiguous_buffers() -> None:
    buffer = torch.empty(64, 64, dtype=torch.uint8).t()
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        pin_host_buffer(buffer, driver=HostDriver())


def test_mapped_offset_of_unpinned_memory_names_the_fix() -> None:
    buffer = torch.empty(MiB, dtype=torch.uint8)
    with pytest.raises(PinningError, match="pin_host_buffer"):
        mapped_offset(HostDriver(), buffer.data_ptr(), buffer.numel())


@pytest.mark.cuda
@needs_cuda
def test_pin_on_cuda_pins_in_chunks_and_unpins() -> None:
    buffer = torch.empty(40 * MiB + 12345, dtype=torch.uint8)
    region = pin_host_buffer(buffer, chunk_bytes=16 * MiB)
    assert region is not None
    assert len(region.chunks) >= 3
    assert buffer.is_pinned()
    device_view = region.device_pointer()
    assert device_view != 0
    region.close()
    assert not buffer.is_pinned()
