"""NVRTC: compiling CUDA C++ source to a CUBIN for one compute capability, at run time.

Only NVRTC is needed, no GPU, so a kernel's source is also checked on build
machines. The library comes from cuda-python's bindings, or, where they cannot
find it, from pip's ``nvidia-cuda-nvrtc`` wheels.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
from pathlib import Path
from typing import Any

from kvtier.cuda.bindings import CudaError, CudaUnavailable, check, cuda_bindings, result_name

logger = logging.getLogger(__name__)

PROGRAM_NAME = b"kvtier_kernel.cu"
"""The source's file name in NVRTC's log lines."""


def nvrtc_arch_option(compute_capability: tuple[int, int]) -> str:
    """The NVRTC ``--gpu-architecture`` option that emits SASS for ``compute_capability``."""
    major, minor = compute_capability
    return f"--gpu-architecture=sm_{major}{minor}"


NVRTC_LIBRARY_DIRS: tuple[tuple[str, str], ...] = (
    ("nvidia.cuda_nvrtc", "lib"),  # nvidia-cuda-nvrtc-cu12, which PyTorch's CUDA 12 wheels use
    ("nvidia.cu13", "lib"),  # nvidia-cuda-nvrtc for CUDA 13
)
"""Where pip's NVRTC wheels put ``libnvrtc.so``: (package, subdirectory)."""


@functools.cache
def _preload_pip_nvrtc() -> bool:
    """Load NVRTC from a pip wheel globally, so bindings that look it up by name find it.

    Returns:
        Whether a library was loaded (at most once per process).
    """
    for package, subdirectory in NVRTC_LIBRARY_DIRS:
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        for directory in getattr(module, "__path__", []):
            for library in sorted(Path(directory, subdirectory).glob("libnvrtc.so.*")):
                try:
                    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
                except OSError as exc:
                    logger.debug("could not load %s: %s", library, exc)
                    continue
                logger.info("loaded NVRTC from %s", library)
                return True
    return False


def _create_program(nvrtc: Any, source: str) -> Any:
    """``nvrtcCreateProgram``, loading NVRTC from a pip wheel first if the bindings cannot."""
    try:
        return nvrtc.nvrtcCreateProgram(source.encode(), PROGRAM_NAME, 0, [], [])
    except (RuntimeError, OSError) as exc:  # the bindings' loader error when libnvrtc is absent
        if _preload_pip_nvrtc():
            try:
                return nvrtc.nvrtcCreateProgram(source.encode(), PROGRAM_NAME, 0, [], [])
            except (RuntimeError, OSError):
                pass
        raise CudaUnavailable(
            f"needs CUDA: the NVRTC library could not be loaded ({type(exc).__name__}: {exc}); "
            "install nvidia-cuda-nvrtc matching the driver"
        ) from exc


@functools.lru_cache(maxsize=16)
def compile_cubin(source: str, compute_capability: tuple[int, int]) -> bytes:
    """Compile CUDA C++ ``source`` to a CUBIN for ``compute_capability`` with NVRTC; cached.

    Needs only NVRTC (no GPU), so it also runs on build machines.

    Raises:
        CudaUnavailable: cuda-python or the NVRTC library is missing.
        CudaError: The compilation failed; the message carries NVRTC's log.
    """
    _, nvrtc = cuda_bindings()
    created = _create_program(nvrtc, source)
    program = check("nvrtcCreateProgram", created)
    try:
        options = [nvrtc_arch_option(compute_capability).encode(), b"--std=c++17", b"-lineinfo"]
        status = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if int(status[0]) != 0:
            log_size = check("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(program))
            log = b" " * log_size
            check("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(program, log))
            raise CudaError(
                f"NVRTC could not compile the kernel source for sm_{compute_capability[0]}"
                f"{compute_capability[1]}: {result_name(status[0])}\n"
                f"{log.decode(errors='replace').strip()}"
            )
        size = check("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(program))
        cubin = b" " * size
        check("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(program, cubin))
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)
