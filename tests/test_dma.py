"""The cuda-python side of the dma backend without a GPU: ABI choice, struct layout, errors."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtier.copy import cuda_driver
from kvtier.copy.cuda_driver import (
    BindingsDriver,
    CudaError,
    CudaUnavailable,
    memcpy_batch_abi,
    open_driver,
)


@pytest.mark.parametrize(
    ("driver_version", "abi"),
    [(12060, None), (12080, 12080), (12090, 12080), (13000, 13000), (13020, 13000)],
)
def test_memcpy_batch_abi_follows_the_driver_version(driver_version: int, abi: int | None) -> None:
    assert memcpy_batch_abi(driver_version) == abi


def test_memcpy_attributes_match_the_c_layout() -> None:
    # CUmemcpyAttributes: srcAccessOrder (enum), two CUmemLocation {type, id}, flags
    attributes = cuda_driver._MemcpyAttributes
    assert ctypes.sizeof(attributes) == 24
    assert attributes.srcLocHint.offset == 4
    assert attributes.dstLocHint.offset == 12
    assert attributes.flags.offset == 20


def test_both_memcpy_batch_prototypes_are_declared() -> None:
    prototypes = cuda_driver._MEMCPY_BATCH_PROTOTYPES
    assert set(prototypes) == set(cuda_driver.MEMCPY_BATCH_ABI_VERSIONS)
    # the 12.8 ABI has the failIdx out-parameter before the stream; 13 dropped it
    assert len(prototypes[12080]._argtypes_) == len(prototypes[13000]._argtypes_) + 1


def test_check_unpacks_results_and_names_failures() -> None:
    assert cuda_driver._check("cuFake", (0,)) is None
    assert cuda_driver._check("cuFake", (0, 7)) == 7
    assert cuda_driver._check("cuFake", (0, 1, 2)) == (1, 2)
    with pytest.raises(CudaError, match=r"cuFake failed with 2 \(2\)"):
        cuda_driver._check("cuFake", (2, None))


def test_nvrtc_arch_option_uses_the_compute_capability() -> None:
    assert cuda_driver.nvrtc_arch_option((9, 0)) == "--gpu-architecture=sm_90"
    assert cuda_driver.nvrtc_arch_option((12, 0)) == "--gpu-architecture=sm_120"


def test_open_driver_refuses_a_cpu_device() -> None:
    with pytest.raises(CudaUnavailable, match=r"^needs CUDA: .* on cpu"):
        open_driver(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_bindings_driver_without_cuda_says_it_needs_cuda() -> None:
    with pytest.raises(CudaUnavailable, match="^needs CUDA: "):
        BindingsDriver(0)
    with pytest.raises(CudaUnavailable, match="^needs CUDA: "):
        open_driver()
