"""The CUDA driver seam: every driver call kvtier makes, behind one interface.

The ``dma``, ``kernel`` and ``auto`` copy backends and host-memory pinning
(:mod:`kvtier.cuda.pinning`) reach CUDA only through a :class:`CudaDriver`.
:class:`BindingsDriver` implements it with cuda-python (``cuda.bindings``) on
one device's primary context, the same context the engine's PyTorch uses, so
no context is ever created on another device.
The tests' ``HostDriver`` (``tests/support/cuda_host_driver.py``) implements it on host memory
(``memmove`` copies, events that complete when their stream drains) so the
pointer arithmetic, batching and event bookkeeping are tested without a GPU.

Handles (streams, events, kernels) and addresses are plain ``int``.

Primitives, in the order a backend uses them:

1. :func:`open_driver` binds to the engine's device (or raises
   :class:`CudaUnavailable`, whose message starts with "needs CUDA").
2. Setup calls run inside :meth:`CudaDriver.activated`; a worker thread calls
   :meth:`CudaDriver.bind_thread` once.
3. Streams and events: :meth:`~CudaDriver.stream_create`,
   :meth:`~CudaDriver.event_create`, :meth:`~CudaDriver.event_record`,
   :meth:`~CudaDriver.stream_wait_event`, :meth:`~CudaDriver.event_query`,
   :meth:`~CudaDriver.event_synchronize`.
4. Copies: :meth:`~CudaDriver.memcpy_batch` (one ``cuMemcpyBatchAsync``) or
   :meth:`~CudaDriver.memcpy_async` per segment where the driver lacks it;
   :meth:`~CudaDriver.load_kernel` (compiled by :mod:`kvtier.cuda.nvrtc`) and
   :meth:`~CudaDriver.launch_kernel`.
5. :meth:`CudaDriver.close` releases what the driver holds.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from kvtier.cuda.bindings import CudaError, CudaUnavailable, check, cuda_bindings, result_name
from kvtier.cuda.nvrtc import compile_cubin

logger = logging.getLogger(__name__)

MEMCPY_BATCH_ABI_VERSIONS: tuple[int, ...] = (13000, 12080)
"""``cuMemcpyBatchAsync`` ABIs, newest first: CUDA 13 dropped the ``failIdx`` out-parameter."""

KernelArg = ctypes.c_uint64 | ctypes.c_uint32 | ctypes.c_int32

# ABI constants of cuda.h, spelled out so that cuda-python releases older than the
# CUDA 12.8 headers (which lack these enums) still drive the per-segment fallback.
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
"""Sources of a batched copy are read in stream order (after the wait on the ready event)."""
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
"""Hint that batched copies should overlap with compute kernels."""
CU_GET_PROC_ADDRESS_DEFAULT = 0


class CudaDriver(ABC):
    """The CUDA driver calls kvtier makes (copy backends, pinning), bound to one device."""

    device_index: int
    """Index of the CUDA device this driver is bound to."""

    @contextmanager
    def activated(self) -> Iterator[None]:
        """Make this driver's context current on the calling thread for the ``with`` body."""
        yield

    def bind_thread(self) -> None:  # noqa: B027 - drivers without contexts need nothing here
        """Make this driver's context current on the calling (worker) thread for good."""

    @abstractmethod
    def driver_version(self) -> int:
        """The driver's CUDA version as ``1000 * major + 10 * minor`` (12.8 is 12080)."""

    @abstractmethod
    def compute_capability(self) -> tuple[int, int]:
        """The device's compute capability as ``(major, minor)``."""

    @abstractmethod
    def host_register(self, address: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` at host ``address``, portable and mapped for the device."""

    @abstractmethod
    def host_unregister(self, address: int) -> None:
        """Undo :meth:`host_register` of the range starting at ``address``."""

    @abstractmethod
    def host_device_pointer(self, address: int) -> int:
        """The device address of page-locked, mapped host memory at ``address``."""

    @abstractmethod
    def host_alloc_mapped(self, nbytes: int) -> int:
        """Allocate ``nbytes`` of page-locked host memory mapped for the device; return it."""

    @abstractmethod
    def host_free(self, address: int) -> None:
        """Free memory from :meth:`host_alloc_mapped`."""

    @abstractmethod
    def lowest_stream_priority(self) -> int:
        """The numerically greatest stream priority: work that yields to every other stream."""

    @abstractmethod
    def stream_create(self, priority: int) -> int:
        """Create a non-blocking stream with ``priority``; return its handle."""

    @abstractmethod
    def stream_destroy(self, stream: int) -> None:
        """Destroy a stream from :meth:`stream_create`."""

    @abstractmethod
    def caller_stream(self) -> int:
        """The calling thread's current stream on this device (the engine's compute stream)."""

    @abstractmethod
    def event_create(self) -> int:
        """Create an event without timing; return its handle."""

    @abstractmethod
    def event_destroy(self, event: int) -> None:
        """Destroy an event from :meth:`event_create`."""

    @abstractmethod
    def event_record(self, event: int, stream: int) -> None:
        """Record ``event`` after the work queued so far on ``stream``."""

    @abstractmethod
    def stream_wait_event(self, stream: int, event: int) -> None:
        """Make later work on ``stream`` wait for ``event``."""

    @abstractmethod
    def event_query(self, event: int) -> bool:
        """Whether the work before ``event`` finished; raise :class:`CudaError` if it failed."""

    @abstractmethod
    def event_synchronize(self, event: int) -> None:
        """Block until the work before ``event`` finished; raise :class:`CudaError` if it failed."""

    @property
    @abstractmethod
    def has_memcpy_batch(self) -> bool:
        """Whether :meth:`memcpy_batch` is available (``cuMemcpyBatchAsync``, driver >= 12.8)."""

    @abstractmethod
    def memcpy_batch(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int
    ) -> None:
        """Queue one batched copy of ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]``.

        Args:
            dsts: Destination addresses, contiguous ``uint64``.
            srcs: Source addresses, contiguous ``uint64``, same length.
            sizes: Bytes per copy, contiguous ``uint64``, same length.
            stream: The stream; the copies read their sources in stream order.
        """

    @abstractmethod
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue one copy of ``nbytes`` from ``src`` to ``dst`` on ``stream``."""

    @abstractmethod
    def load_kernel(self, source: str, name: str) -> int:
        """Compile ``source`` for this device (cached), load it, return kernel ``name``."""

    @abstractmethod
    def launch_kernel(
        self,
        kernel: int,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        stream: int,
    ) -> None:
        """Queue ``kernel`` on ``stream`` with ``args`` (ctypes scalars, in parameter order)."""

    def close(self) -> None:  # noqa: B027 - drivers that hold nothing have nothing to release
        """Release what this driver holds (loaded kernels, its context reference). Idempotent."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (identical in the CUDA 12.8 and 13 ABIs)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_MEMCPY_BATCH_PROTOTYPES: dict[int, Any] = {
    # CUresult cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs,
    #                             failIdx, hStream)
    12080: ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ),
    # CUresult cuMemcpyBatchAsync_v2(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, hStream)
    13000: ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
    ),
}


def memcpy_batch_abi(driver_version: int) -> int | None:
    """The ``cuMemcpyBatchAsync`` ABI to request from a driver of ``driver_version``.

    Returns:
        The newest ABI version the driver supports, or ``None`` before CUDA 12.8.
    """
    for abi in MEMCPY_BATCH_ABI_VERSIONS:
        if driver_version >= abi:
            return abi
    return None


class BindingsDriver(CudaDriver):
    """:class:`CudaDriver` on cuda-python, bound to one device's primary context.

    Args:
        device_index: The CUDA device (the engine's). Only its primary context
            is retained, so no context appears on any other device.

    Raises:
        CudaUnavailable: cuda-python, the driver or the device is missing.
    """

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self._cu, _ = cuda_bindings()
        cu = self._cu
        try:
            check("cuInit", cu.cuInit(0))
        except CudaError as exc:
            raise CudaUnavailable(
                f"needs CUDA: the CUDA driver did not initialise ({exc})"
            ) from exc
        except (RuntimeError, OSError) as exc:  # the bindings' loader error when libcuda is absent
            raise CudaUnavailable(
                f"needs CUDA: the CUDA driver library could not be loaded "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        count = check("cuDeviceGetCount", cu.cuDeviceGetCount())
        if not 0 <= device_index < count:
            raise CudaUnavailable(
                f"needs CUDA: device {device_index} does not exist ({count} visible devices)"
            )
        self._device = check("cuDeviceGet", cu.cuDeviceGet(device_index))
        self._context = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._device))
        self._lock = threading.Lock()
        self._modules: list[Any] = []
        self._kernels: dict[tuple[str, str], Any] = {}
        self._closed = False
        self._memcpy_batch_abi = memcpy_batch_abi(self.driver_version())
        self._memcpy_batch_fn: Any = None
        if self._memcpy_batch_abi is not None:
            self._memcpy_batch_fn = self._resolve_memcpy_batch(self._memcpy_batch_abi)
        self._attrs = _MemcpyAttributes(
            srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            flags=CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
        )
        self._attrs_index = ctypes.c_size_t(0)
        logger.debug(
            "CUDA driver %d bound to device %d; cuMemcpyBatchAsync ABI %s",
            self.driver_version(),
            device_index,
            self._memcpy_batch_abi,
        )

    def _resolve_memcpy_batch(self, abi: int) -> Any:
        cu = self._cu
        result = cu.cuGetProcAddress(b"cuMemcpyBatchAsync", abi, CU_GET_PROC_ADDRESS_DEFAULT)
        status, address = result[0], result[1]
        if int(status) != 0 or not int(address):
            logger.warning(
                "CUDA driver %d does not provide cuMemcpyBatchAsync for ABI %d (%s); "
                "copying segment by segment",
                self.driver_version(),
                abi,
                result_name(status),
            )
            return None
        return _MEMCPY_BATCH_PROTOTYPES[abi](int(address))

    @contextmanager
    def activated(self) -> Iterator[None]:
        check("cuCtxPushCurrent", self._cu.cuCtxPushCurrent(self._context))
        try:
            yield
        finally:
            check("cuCtxPopCurrent", self._cu.cuCtxPopCurrent())

    def bind_thread(self) -> None:
        check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(self._context))

    def driver_version(self) -> int:
        return int(check("cuDriverGetVersion", self._cu.cuDriverGetVersion()))

    def compute_capability(self) -> tuple[int, int]:
        attr = self._cu.CUdevice_attribute
        major = check(
            "cuDeviceGetAttribute",
            self._cu.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._device
            ),
        )
        minor = check(
            "cuDeviceGetAttribute",
            self._cu.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._device
            ),
        )
        return int(major), int(minor)

    def host_register(self, address: int, nbytes: int) -> None:
        flags = self._cu.CU_MEMHOSTREGISTER_PORTABLE | self._cu.CU_MEMHOSTREGISTER_DEVICEMAP
        check("cuMemHostRegister", self._cu.cuMemHostRegister(address, nbytes, flags))

    def host_unregister(self, address: int) -> None:
        check("cuMemHostUnregister", self._cu.cuMemHostUnregister(address))

    def host_device_pointer(self, address: int) -> int:
        # cuPointerGetAttribute, unlike cuMemHostGetDevicePointer, is specified for any address
        # inside a registration, not only for its start.
        attribute = self._cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        pointer = check(
            "cuPointerGetAttribute(DEVICE_POINTER)",
            self._cu.cuPointerGetAttribute(attribute, self._cu.CUdeviceptr(address)),
        )
        return int(pointer)

    def host_alloc_mapped(self, nbytes: int) -> int:
        flags = self._cu.CU_MEMHOSTALLOC_PORTABLE | self._cu.CU_MEMHOSTALLOC_DEVICEMAP
        return int(check("cuMemHostAlloc", self._cu.cuMemHostAlloc(nbytes, flags)))

    def host_free(self, address: int) -> None:
        check("cuMemFreeHost", self._cu.cuMemFreeHost(address))

    def lowest_stream_priority(self) -> int:
        least, _greatest = check(
            "cuCtxGetStreamPriorityRange", self._cu.cuCtxGetStreamPriorityRange()
        )
        return int(least)

    def stream_create(self, priority: int) -> int:
        flags = int(self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        return int(
            check(
                "cuStreamCreateWithPriority", self._cu.cuStreamCreateWithPriority(flags, priority)
            )
        )

    def stream_destroy(self, stream: int) -> None:
        check("cuStreamDestroy", self._cu.cuStreamDestroy(self._cu.CUstream(stream)))

    def caller_stream(self) -> int:
        return int(torch.cuda.current_stream(torch.device("cuda", self.device_index)).cuda_stream)

    def event_create(self) -> int:
        flags = int(self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        return int(check("cuEventCreate", self._cu.cuEventCreate(flags)))

    def event_destroy(self, event: int) -> None:
        check("cuEventDestroy", self._cu.cuEventDestroy(self._cu.CUevent(event)))

    def event_record(self, event: int, stream: int) -> None:
        check(
            "cuEventRecord",
            self._cu.cuEventRecord(self._cu.CUevent(event), self._cu.CUstream(stream)),
        )

    def stream_wait_event(self, stream: int, event: int) -> None:
        check(
            "cuStreamWaitEvent",
            self._cu.cuStreamWaitEvent(self._cu.CUstream(stream), self._cu.CUevent(event), 0),
        )

    def event_query(self, event: int) -> bool:
        (status,) = self._cu.cuEventQuery(self._cu.CUevent(event))
        if status == self._cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check("cuEventQuery", (status,))
        return True

    def event_synchronize(self, event: int) -> None:
        check("cuEventSynchronize", self._cu.cuEventSynchronize(self._cu.CUevent(event)))

    @property
    def has_memcpy_batch(self) -> bool:
        return self._memcpy_batch_fn is not None

    def memcpy_batch(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int
    ) -> None:
        if self._memcpy_batch_fn is None:
            raise CudaError(
                f"cuMemcpyBatchAsync needs a CUDA 12.8 driver or newer; this one is "
                f"{self.driver_version()}"
            )
        count = len(sizes)
        for array in (dsts, srcs, sizes):
            if array.dtype != np.uint64 or not array.flags.c_contiguous or len(array) != count:
                raise ValueError("memcpy_batch takes three contiguous uint64 arrays of one length")
        if count == 0:
            return
        common = (
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            count,
            ctypes.addressof(self._attrs),
            ctypes.addressof(self._attrs_index),
            1,
        )
        if self._memcpy_batch_abi == 12080:
            fail_index = ctypes.c_size_t(0)
            status = self._memcpy_batch_fn(*common, ctypes.addressof(fail_index), stream)
            detail = f", first failing copy {fail_index.value}"
        else:
            status = self._memcpy_batch_fn(*common, stream)
            detail = ""
        if status != 0:
            name = result_name(self._cu.CUresult(status))
            raise CudaError(
                f"cuMemcpyBatchAsync of {count} copies failed with {name} ({status}){detail}"
            )

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        cu = self._cu
        check(
            "cuMemcpyAsync",
            cu.cuMemcpyAsync(cu.CUdeviceptr(dst), cu.CUdeviceptr(src), nbytes, cu.CUstream(stream)),
        )

    def load_kernel(self, source: str, name: str) -> int:
        with self._lock:
            function = self._kernels.get((source, name))
            if function is None:
                cubin = np.frombuffer(compile_cubin(source, self.compute_capability()), np.uint8)
                module = check("cuModuleLoadData", self._cu.cuModuleLoadData(cubin.ctypes.data))
                self._modules.append(module)
                function = check(
                    "cuModuleGetFunction", self._cu.cuModuleGetFunction(module, name.encode())
                )
                self._kernels[(source, name)] = function
            return int(function)

    def launch_kernel(
        self,
        kernel: int,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        stream: int,
    ) -> None:
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(arg) for arg in args))
        cu = self._cu
        check(
            "cuLaunchKernel",
            cu.cuLaunchKernel(
                cu.CUfunction(kernel),
                *grid,
                *block,
                0,
                cu.CUstream(stream),
                ctypes.addressof(pointers),
                0,
            ),
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with self.activated():
                for module in self._modules:
                    check("cuModuleUnload", self._cu.cuModuleUnload(module))
            self._modules.clear()
            self._kernels.clear()
            check("cuDevicePrimaryCtxRelease", self._cu.cuDevicePrimaryCtxRelease(self._device))


def open_driver(device: torch.device | int | None = None) -> BindingsDriver:
    """Bind a :class:`BindingsDriver` to ``device`` (default: the current CUDA device).

    Raises:
        CudaUnavailable: ``device`` is not a CUDA device, or CUDA cannot be used here.
    """
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise CudaUnavailable(
                f"needs CUDA: the engine's KV cache is on {device}, not on a CUDA device; "
                "use copy.type=torch"
            )
        index = device.index
    else:
        index = device
    if index is None:
        if not torch.cuda.is_available():
            raise CudaUnavailable("needs CUDA: PyTorch sees no CUDA device")
        index = torch.cuda.current_device()
    return BindingsDriver(index)
