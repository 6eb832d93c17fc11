"""The host tier: sizing from bytes, the buffer, pinning only for CUDA layouts."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import load_config
from kvtier.tiers import HostTier, capacity_per_rank, slots_for_bytes


def test_capacity_splits_over_ranks_unless_given_per_rank() -> None:
    config = load_config({"cpu_bytes": 1000})
    assert capacity_per_rank(config, 1) == 1000
    assert capacity_per_rank(config, 4) == 250
    per_rank = load_config({"cpu_bytes": 1000, "cpu_bytes_per_rank": 700})
    assert capacity_per_rank(per_rank, 4) == 700
    with pytest.raises(ValueError, match="world_size must be positive"):
        capacity_per_rank(config, 0)


def test_slots_for_bytes() -> None:
    assert slots_for_bytes(1000, 100) == 10
    assert slots_for_bytes(1099, 100) == 10
    with pytest.raises(ValueError, match="hold no block"):
        slots_for_bytes(99, 100)
    with pytest.raises(ValueError, match="record_bytes must be positive"):
        slots_for_bytes(100, 0)


def test_buffer_shape_and_close() -> None:
    tier = HostTier(5, 48)
    assert tier.buffer.shape == (5, 48) and tier.buffer.dtype == torch.uint8
    assert tier.buffer.is_contiguous()
    assert tier.nbytes == 240
    assert not tier.pinned
    tier.close()
    tier.close()
    tier.buffer[4, 47] = 1


def test_cpu_layouts_are_not_pinned() -> None:
    tier = HostTier.for_device(1024, 100, torch.device("cpu"))
    assert tier.num_slots == 10 and not tier.pinned


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive sizes"):
        HostTier(0, 16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layouts_pin_the_buffer() -> None:
    tier = HostTier.for_device(1 << 20, 4096, torch.device("cuda"))
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
