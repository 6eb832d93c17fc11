"""The host tier: sizing from bytes, the buffer, pinning only for CUDA layouts."""

from __future__ import annotations

import mmap

import pytest
import torch

from kvtier.config import ConfigError, load_config, model
from kvtier.tiers import HostTier, host


def test_from_config_sizes_one_ranks_share() -> None:
    config = load_config({"cpu_bytes": 1099}, env={})
    assert HostTier.from_config(config, 100, torch.device("cpu")).num_slots == 10
    assert HostTier.from_config(config, 100, torch.device("cpu"), world_size=4).num_slots == 2
    with pytest.raises(ConfigError, match="below one block record"):
        HostTier.from_config(config, 100, torch.device("cpu"), world_size=11)


def test_from_config_checks_memory_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_allocation(*args: object, **kwargs: object) -> None:
        raise AssertionError("the buffer was allocated")

    monkeypatch.setattr(model, "available_memory_bytes", lambda: 1000)
    monkeypatch.setattr(host, "populated_buffer", no_allocation)
    config = load_config({"cpu_bytes": "1000TiB"}, env={})
    with pytest.raises(ConfigError) as caught:
        HostTier.from_config(config, 4096, torch.device("cpu"), world_size=8)
    assert caught.value.lines == [
        "explicit: cpu_bytes: one rank of 8 needs 137438953472000 bytes (128000.0 GiB), more than "
        "the 1000 bytes (0.0 GiB) of memory available on this machine; lower cpu_bytes "
        "(got 1099511627776000)"
    ]


def test_buffer_shape_and_close() -> None:
    tier = HostTier(5, 48)
    assert tier.buffer.shape == (5, 48) and tier.buffer.dtype == torch.uint8
    assert tier.buffer.is_contiguous()
    assert tier.nbytes == 240
    assert not tier.pinned
    tier.close()
    tier.close()
    tier.buffer[4, 47] = 1


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.parametrize("kernel_populates", [True, False])
def test_buffer_pages_are_faulted_in_when_it_is_built(
    monkeypatch: pytest.MonkeyPatch, kernel_populates: bool
) -> None:
    if not kernel_populates:
        # an advice the kernel refuses, as kernels before 5.14 refuse MADV_POPULATE_WRITE
        monkeypatch.setattr(host, "MADV_POPULATE_WRITE", 12345)
    nbytes = 64 << 20
    before = _resident_bytes()
    buffer = host.populated_buffer(nbytes)
    assert _resident_bytes() - before >= nbytes * 0.9
    assert buffer.shape == (nbytes,) and buffer.data_ptr() % mmap.PAGESIZE == 0
    assert not buffer[:: mmap.PAGESIZE].any()
    buffer[-1] = 7
    assert int(buffer[-1]) == 7


def test_cpu_layouts_are_not_pinned() -> None:
    tier = HostTier.from_config(load_config({"cpu_bytes": 1024}, env={}), 100, torch.device("cpu"))
    assert tier.num_slots == 10 and not tier.pinned


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive sizes"):
        HostTier(0, 16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layouts_pin_the_buffer() -> None:
    config = load_config({"cpu_bytes": "1MiB"}, env={})
    tier = HostTier.from_config(config, 4096, torch.device("cuda"))
    assert tier.pinned
    tier.close()
    assert not tier.pinned


class _FakeRegion:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_pinning_is_requested_and_released(monkeypatch: pytest.MonkeyPatch) -> None:
    region = _FakeRegion()
    seen: list[torch.Tensor] = []

    def fake_pin(buffer: torch.Tensor) -> _FakeRegion:
        seen.append(buffer)
        return region

    monkeypatch.setattr("kvtier.tiers.host.pin_host_buffer", fake_pin)
    tier = HostTier(4, 64, pin=True)
    assert seen == [tier.buffer] and tier.pinned
    tier.close()
    tier.close()
    assert region.closed == 1 and not tier.pinned


def test_failed_pinning_leaves_a_pageable_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvtier.tiers.host.pin_host_buffer", lambda buffer: None)
    tier = HostTier(4, 64, pin=True)
    assert not tier.pinned
