"""NVRTC without a GPU: the architecture option and a failed compile's message."""

from __future__ import annotations

import pytest

from kvtier.cuda.bindings import CudaError, CudaUnavailable
from kvtier.cuda.nvrtc import compile_cubin, nvrtc_arch_option


def test_nvrtc_arch_option_uses_the_compute_capability() -> None:
    assert nvrtc_arch_option((9, 0)) == "--gpu-architecture=sm_90"
    assert nvrtc_arch_option((12, 0)) == "--gpu-architecture=sm_120"


def test_a_compile_error_carries_the_nvrtc_log() -> None:
    source = 'extern "C" __global__ void broken() { undeclared_name = 1; }'
    try:
        compile_cubin(source, (9, 0))
    except CudaUnavailable as exc:
        pytest.skip(f"NVRTC is not installed here: {exc}")
    except CudaError as exc:
        assert "sm_90" in str(exc) and "undeclared_name" in str(exc)
    else:
        pytest.fail("a kernel with an undeclared name compiled")
