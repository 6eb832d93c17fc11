"""The cuda-python driver binding without a GPU: ABI choice, struct layout, errors."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvtier.cuda import driver as cuda_driver
from kvtier.cuda.bindings import CudaError, CudaUnavailable, check
from kvtier.cuda.driver import BindingsDriver, memcpy_batch_abi, open_driver


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
    assert check("cuFake", (0,)) is None
    assert check("cuFake", (0, 7)) == 7
    assert check("cuFake", (0, 1, 2)) == (1, 2)
    with pytest.raises(CudaError, match=r"cuFake failed with 2 \(2\)"):
        check("cuFake", (2, None))


def test_open_driver_refuses_a_cpu_device() -> None:
    with pytest.raises(CudaUnavailable, match=r"^needs CUDA: .* on cpu"):
        open_driver(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_bindings_driver_without_cuda_says_it_needs_cuda() -> None:
    with pytest.raises(CudaUnavailable, match="^needs CUDA: "):
        BindingsDriver(0)
    with pytest.raises(CudaUnavailable, match="^needs CUDA: "):
        open_driver()


def _offline_bindings_driver() -> BindingsDriver:
    """A BindingsDriver whose handles are made up: its calls reach the bindings, not a GPU."""
    bindings = pytest.importorskip("cuda.bindings.driver")
    if torch.cuda.is_available():
        pytest.skip("checks argument conversion where no driver can be loaded")
    driver = object.__new__(BindingsDriver)
    driver._cu = bindings
    driver._context = bindings.CUcontext(0)
    driver._device = bindings.CUdevice(0)
    driver.device_index = 0
    driver._lock = threading.Lock()
    driver._modules = []
    driver._kernels = {}
    driver._closed = False
    driver._memcpy_batch_abi = None
    driver._memcpy_batch_fn = None
    driver._attrs = cuda_driver._MemcpyAttributes(
        srcAccessOrder=cuda_driver.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        flags=cuda_driver.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
    )
    driver._attrs_index = ctypes.c_size_t(0)
    return driver


CALLS: dict[str, Callable[[BindingsDriver], object]] = {
    "activated": lambda d: d.activated().__enter__(),
    "bind_thread": lambda d: d.bind_thread(),
    "driver_version": lambda d: d.driver_version(),
    "compute_capability": lambda d: d.compute_capability(),
    "host_register": lambda d: d.host_register(0x10000, 4096),
    "host_unregister": lambda d: d.host_unregister(0x10000),
    "host_device_pointer": lambda d: d.host_device_pointer(0x10000),
    "host_alloc_mapped": lambda d: d.host_alloc_mapped(4096),
    "host_free": lambda d: d.host_free(0x10000),
    "lowest_stream_priority": lambda d: d.lowest_stream_priority(),
    "stream_create": lambda d: d.stream_create(0),
    "stream_destroy": lambda d: d.stream_destroy(0x1234),
    "event_create": lambda d: d.event_create(),
    "event_destroy": lambda d: d.event_destroy(0x1234),
    "event_record": lambda d: d.event_record(0x1234, 0x5678),
    "stream_wait_event": lambda d: d.stream_wait_event(0x5678, 0x1234),
    "event_query": lambda d: d.event_query(0x1234),
    "event_synchronize": lambda d: d.event_synchronize(0x1234),
    "memcpy_async": lambda d: d.memcpy_async(0x1000, 0x2000, 64, 0x5678),
    "launch_kernel": lambda d: d.launch_kernel(
        0x4321, (3, 1, 1), (256, 1, 1), (ctypes.c_uint64(5), ctypes.c_uint32(3)), 0x5678
    ),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_bindings_accept_the_arguments_the_driver_passes(call: str) -> None:
    """Without a GPU the bindings fail loading libcuda, which they do only after
    converting the arguments: a TypeError here is a call the GPU would reject too."""
    driver = _offline_bindings_driver()
    with pytest.raises(RuntimeError):
        CALLS[call](driver)


@pytest.mark.parametrize("abi", [12080, 13000])
def test_memcpy_batch_marshals_arrays_attributes_and_stream(abi: int) -> None:
    driver = _offline_bindings_driver()
    seen: dict[str, object] = {}

    def fake_memcpy_batch(*args: int) -> int:
        dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, *rest = args

        def read(address: int) -> list[int]:
            return list((ctypes.c_uint64 * count).from_address(address))

        attributes = cuda_driver._MemcpyAttributes.from_address(attrs)
        seen.update(
            dsts=read(dsts),
            srcs=read(srcs),
            sizes=read(sizes),
            order=attributes.srcAccessOrder,
            flags=attributes.flags,
            first_index=ctypes.c_size_t.from_address(attrs_idxs).value,
            num_attrs=num_attrs,
            stream=rest[-1],
            rest=len(rest),
        )
        return 0

    callback = cuda_driver._MEMCPY_BATCH_PROTOTYPES[abi](fake_memcpy_batch)
    driver._memcpy_batch_abi, driver._memcpy_batch_fn = abi, callback
    dsts, srcs, sizes = (np.array(v, dtype=np.uint64) for v in ([10, 20], [30, 40], [5, 6]))
    driver.memcpy_batch(dsts, srcs, sizes, 0xBEEF)
    assert seen == {
        "dsts": [10, 20],
        "srcs": [30, 40],
        "sizes": [5, 6],
        "order": 1,  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: after the wait on the ready event
        "flags": 1,
        "first_index": 0,
        "num_attrs": 1,
        "stream": 0xBEEF,
        "rest": 2 if abi == 12080 else 1,  # (failIdx, stream) or (stream)
    }


def test_memcpy_batch_failure_names_the_error_and_the_failing_copy() -> None:
    driver = _offline_bindings_driver()

    def fake_memcpy_batch(*args: int) -> int:
        ctypes.c_size_t.from_address(args[7]).value = 1
        return 1

    prototype = cuda_driver._MEMCPY_BATCH_PROTOTYPES[12080]
    driver._memcpy_batch_abi, driver._memcpy_batch_fn = 12080, prototype(fake_memcpy_batch)
    array = np.array([1, 2], dtype=np.uint64)
    with pytest.raises(CudaError, match=r"CUDA_ERROR_INVALID_VALUE \(1\), first failing copy 1"):
        driver.memcpy_batch(array, array.copy(), array.copy(), 7)
    with pytest.raises(ValueError, match="contiguous uint64"):
        driver.memcpy_batch(array.astype(np.int64), array, array, 7)


def test_abi_constants_match_the_bindings() -> None:
    bindings = pytest.importorskip("cuda.bindings.driver")
    order = bindings.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    overlap = bindings.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    default = bindings.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    assert int(order) == cuda_driver.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    assert int(overlap) == cuda_driver.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    assert int(default) == cuda_driver.CU_GET_PROC_ADDRESS_DEFAULT
