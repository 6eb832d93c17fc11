"""The CUDA layer under the GPU copy backends: driver binding, NVRTC, host-memory pinning.

- :mod:`kvtier.cuda.bindings`: cuda-python, imported on first use; errors.
- :mod:`kvtier.cuda.driver`: :class:`CudaDriver`, the seam every driver call
  goes through, and :class:`~kvtier.cuda.driver.BindingsDriver` on cuda-python.
- :mod:`kvtier.cuda.nvrtc`: compiling kernel source at run time.
- :mod:`kvtier.cuda.pinning`: page-locking the host tier's buffer in chunks.

The copy backends and the host tier build on this package; it imports
neither of them.
"""

from kvtier.cuda.bindings import CudaError, CudaUnavailable
from kvtier.cuda.driver import CudaDriver, open_driver
from kvtier.cuda.pinning import PinnedRegion, PinningError, pin_host_buffer

__all__ = [
    "CudaDriver",
    "CudaError",
    "CudaUnavailable",
    "PinnedRegion",
    "PinningError",
    "open_driver",
    "pin_host_buffer",
]
