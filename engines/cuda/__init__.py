"""A small CUDA memory interface for the TensorRT backend, as backends/ is laid out: the protocol in `base`, one
module per implementation (`cuda_python`, `pycuda_memory`), and here the door that picks the first that works."""

from __future__ import annotations

import logging

from engines.cuda.base import (IMPLEMENTATIONS, CudaError, CudaMemory, DeviceBuffer, cuda_version_text, import_cudart,
                               missing_bindings, version_mismatch_fix)

log = logging.getLogger(__name__)

__all__ = ["IMPLEMENTATIONS", "CudaError", "CudaMemory", "DeviceBuffer", "availability", "cuda_version_text",
           "import_cudart", "missing_bindings", "open_cuda_memory", "open_implementation", "version_mismatch_fix"]


def open_implementation(name: str) -> CudaMemory:
    """Open one named implementation, raising its own error (ImportError, CudaError...): for the doctor."""
    return _open(name)


def _open(name: str) -> CudaMemory:
    if name == "cuda-python":
        from engines.cuda.cuda_python import CudaPythonMemory

        return CudaPythonMemory()
    if name == "pycuda":
        from engines.cuda.pycuda_memory import PyCudaMemory

        return PyCudaMemory()
    raise ValueError(f"unknown CUDA memory implementation {name!r} (known: {', '.join(IMPLEMENTATIONS)})")


def open_cuda_memory(prefer: str | None = None) -> CudaMemory:
    """The first implementation that imports and reaches a GPU; the error lists why each did not."""
    reasons = {}
    for name in ([prefer] if prefer else list(IMPLEMENTATIONS)):
        try:
            return _open(name)
        except (ImportError, CudaError, RuntimeError, OSError) as exc:
            reasons[name] = f"{type(exc).__name__}: {exc}"
            log.info("CUDA memory via %s unavailable: %s", name, reasons[name])
    detail = "; ".join(f"{k}: {v}" for k, v in reasons.items())
    raise CudaError(f"no usable CUDA memory implementation ({detail}); install cuda-python "
                    "(`pip install cuda-python`) or pycuda", code="BACKEND_UNAVAILABLE")


def availability() -> dict[str, str | None]:
    """Each implementation -> None when usable here, else the reason (for contract tests and status)."""
    out: dict[str, str | None] = {}
    for name in IMPLEMENTATIONS:
        try:
            _open(name).close()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - report any failure mode (missing module, no driver, no GPU)
            out[name] = f"{type(exc).__name__}: {exc}"
    return out
