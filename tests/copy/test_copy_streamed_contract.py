"""The copy-backend contract suite on the dma, kernel and auto backends, on the host-memory driver.

Every CUDA call goes through :class:`~tests.support.cuda_host_driver.HostDriver`;
``test_copy_streamed_on_cuda.py`` runs the same suite on a real device.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvtier.copy.auto import AutoCopyConfig, AutoExecutor
from kvtier.copy.base import CopyBackend
from kvtier.copy.dma import DmaCopyConfig, DmaExecutor
from kvtier.copy.kernel import KernelCopyConfig, KernelExecutor
from kvtier.copy.streamed import SegmentExecutor, StreamCopyBackend
from kvtier.cuda.pinning import pin_host_buffer
from kvtier.layout.base import KVLayout
from kvtier.testing.contracts_copy import BackendFactory, CopyBackendContract
from tests.support.cuda_host_driver import HostDriver


def _on_host_driver(make_executor: Callable[[], SegmentExecutor]) -> BackendFactory:
    def factory(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
        driver = HostDriver()
        pin_host_buffer(host_buffer, chunk_bytes=2 << 20, driver=driver)
        return StreamCopyBackend(layout, host_buffer, make_executor(), driver=driver)

    return factory


class TestDmaOnHostDriver(CopyBackendContract):
    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return _on_host_driver(lambda: DmaExecutor(DmaCopyConfig()))


class TestKernelOnHostDriver(CopyBackendContract):
    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return _on_host_driver(lambda: KernelExecutor(KernelCopyConfig(chunk_bytes=256)))


class TestAutoOnHostDriver(CopyBackendContract):
    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return _on_host_driver(lambda: AutoExecutor(AutoCopyConfig(kernel_below_bytes=1024)))
