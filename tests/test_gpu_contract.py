"""The copy-backend contract suite on the dma, kernel and auto backends.

On the CPU every CUDA call goes through the host-memory driver; the same suite
runs on a real device through the registered factories (marked ``cuda``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvtier.config import PluginConfig
from kvtier.copy.auto import AutoCopyConfig, AutoExecutor
from kvtier.copy.base import CopyBackend
from kvtier.copy.cuda_stream import SegmentExecutor, StreamCopyBackend
from kvtier.copy.dma import DmaCopyConfig, DmaExecutor
from kvtier.copy.host_driver import HostDriver
from kvtier.copy.kernel import KernelCopyConfig, KernelExecutor
from kvtier.layout.base import KVLayout
from kvtier.plugins import default_registry
from kvtier.testing.contracts_copy import BackendFactory, CopyBackendContract
from kvtier.tiers.pinning import pin_host_buffer


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "config", [DmaCopyConfig(), KernelCopyConfig(), AutoCopyConfig()], ids=["dma", "kernel", "auto"]
)
class TestOnCuda(CopyBackendContract):
    @pytest.fixture
    def device(self) -> str:
        return "cuda"

    @pytest.fixture
    def backend_factory(self, config: PluginConfig) -> BackendFactory:
        return lambda layout, host: default_registry().build("copy_backends", config, layout, host)
