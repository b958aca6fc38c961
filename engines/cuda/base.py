"""A small CUDA memory interface for the TensorRT backend: buffers, pinned host arrays, streams, events.

Two implementations sit behind it, tried in this order:
- `cuda-python` (engines/cuda/cuda_python.py: `cuda.bindings.runtime`, or `cuda.cudart` on older releases): what
  NVIDIA's own TensorRT samples use since 8.6, wheels for x86-64 and aarch64;
- `pycuda` (engines/cuda/pycuda_memory.py): for JetPack images that only ship it.
Both use the device's primary context, the one TensorRT's runtime API calls use, so buffers and
streams from either are valid for `execute_async_v3`. CUDA graphs are optional (`supports_graphs`).

Opening an implementation initialises CUDA (`cudaFree(0)`), so "opened" means "really runs here",
not only "imports": cuda-python 13.x links the CUDA 13 runtime statically and fails right there on a
JetPack 6 driver (CUDA 12.x); the error then names both versions and the pip pin that fixes it.
Optional extras beyond the Protocol: `versions()`, `device_properties()`, `clear_error()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from kernel.errors import EdgeError


IMPLEMENTATIONS = ("cuda-python", "pycuda")


class CudaError(EdgeError):
    """A CUDA call failed; the message names the call and CUDA's error name."""

    code = "CUDA_ERROR"


@dataclass
class DeviceBuffer:
    """Device memory: its address (for `set_tensor_address`), size, and the implementation's handle."""

    ptr: int
    nbytes: int
    handle: Any = None


class CudaMemory(Protocol):
    """What the TensorRT runtime needs from CUDA, nothing more."""

    name: str
    supports_graphs: bool

    def malloc(self, nbytes: int) -> DeviceBuffer: ...
    def free(self, buffer: DeviceBuffer) -> None: ...
    def pinned_empty(self, shape: Sequence[int], dtype: Any) -> np.ndarray: ...
    def free_pinned(self, array: np.ndarray) -> None: ...
    def create_stream(self) -> Any: ...
    def destroy_stream(self, stream: Any) -> None: ...
    def stream_handle(self, stream: Any) -> int: ...
    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Any) -> None: ...
    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Any) -> None: ...
    def synchronize(self, stream: Any) -> None: ...
    def create_event(self) -> Any: ...
    def record_event(self, event: Any, stream: Any) -> None: ...
    def synchronize_event(self, event: Any) -> None: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def destroy_event(self, event: Any) -> None: ...
    def mem_get_info(self) -> tuple[int, int]: ...
    def begin_capture(self, stream: Any) -> None: ...
    def end_capture(self, stream: Any) -> Any: ...
    def launch_graph(self, graph: Any, stream: Any) -> None: ...
    def destroy_graph(self, graph: Any) -> None: ...
    def close(self) -> None: ...


def import_cudart() -> Any:
    """cuda-python's runtime module under its current or its older name."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        from cuda import cudart  # older releases (JetPack 5/6 images)
    return cudart


def cuda_version_text(value: int | None) -> str | None:
    """12060 -> "12.6" (CUDA encodes 1000*major + 10*minor); 0/None -> None."""
    if not value:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}"


def version_mismatch_fix(built: int | None, driver: int | None, package: str = "cuda-python") -> str | None:
    """After a failed CUDA init: the pip pin that matches the driver when the binding is built for a newer CUDA.

    Pinned to the driver's major.minor: JetPack 6 (Orin) drivers are not SBSA drivers, so a binding
    for a newer minor is not assumed to run on them either.
    """
    if not built or not driver or built <= driver:
        return None
    major, minor = driver // 1000, (driver % 1000) // 10
    return (f"{package} is built for CUDA {cuda_version_text(built)} but this driver supports CUDA "
            f"{cuda_version_text(driver)}: `pip install '{package}>={major}.{minor},<{major}.{minor + 1}'`")


def missing_bindings() -> str | None:
    """None when cuda-python or pycuda imports (no GPU needed), else why neither does."""
    try:
        import_cudart()
        return None
    except ImportError as exc:
        first = exc
    try:
        import pycuda.driver  # noqa: F401 - only to see whether pycuda imports
        return None
    except ImportError as exc:
        return (f"neither cuda-python ({first}) nor pycuda ({exc}) is installed; "
                "TensorRT needs one for device memory: `pip install cuda-python`")
