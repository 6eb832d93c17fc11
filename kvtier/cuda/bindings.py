"""cuda-python, imported when first needed, and the checks every driver and NVRTC call goes through.

cuda-python is an optional dependency (``kvtier[cuda]``): nothing imports it
until a CUDA path is taken, and its absence surfaces as
:class:`CudaUnavailable`, whose message starts with "needs CUDA".
"""

from __future__ import annotations

from typing import Any


class CudaError(RuntimeError):
    """A CUDA driver or NVRTC call failed; the message names the call and the error code."""


class CudaUnavailable(CudaError):
    """CUDA cannot be used in this process (no cuda-python, no driver, no device)."""


def cuda_bindings() -> tuple[Any, Any]:
    """cuda-python's ``(driver, nvrtc)`` binding modules.

    Raises:
        CudaUnavailable: cuda-python is not installed.
    """
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as exc:
        raise CudaUnavailable(
            "needs CUDA: cuda-python is not installed; install kvtier[cuda] "
            f"(pip install cuda-python) ({exc})"
        ) from exc
    return driver, nvrtc


def result_name(code: Any) -> str:
    """The symbolic name of a driver or NVRTC status code (``CUDA_ERROR_INVALID_VALUE``)."""
    name = getattr(code, "name", None)
    return name if name is not None else str(code)


def check(call: str, result: Any) -> Any:
    """Unpack a cuda-bindings ``(status, *values)`` result; raise :class:`CudaError` on failure.

    Args:
        call: The call's name, for the error message.
        result: What the binding returned: a status, or a status and values.

    Returns:
        ``None`` without values, the value alone, or a tuple of several.
    """
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise CudaError(f"{call} failed with {result_name(status)} ({int(status)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
