"""A small CUDA memory interface for the TensorRT backend: buffers, pinned host arrays, streams, events.

Two implementations sit behind it, tried in this order:
- `cuda-python` (`cuda.bindings.runtime`, or `cuda.cudart` on older releases): what NVIDIA's own
  TensorRT samples use since 8.6, wheels for x86-64 and aarch64;
- `pycuda` (engines/cuda_mem_pycuda.py): for JetPack images that only ship it.
Both use the device's primary context, the one TensorRT's runtime API calls use, so buffers and
streams from either are valid for `execute_async_v3`. CUDA graphs are optional (`supports_graphs`).

Opening an implementation initialises CUDA (`cudaFree(0)`), so "opened" means "really runs here",
not only "imports": cuda-python 13.x links the CUDA 13 runtime statically and fails right there on a
JetPack 6 driver (CUDA 12.x); the error then names both versions and the pip pin that fixes it.
Optional extras beyond the Protocol: `versions()`, `device_properties()`, `clear_error()`.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from engines.errors import EdgeError

log = logging.getLogger(__name__)

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
        import pycuda.driver  # noqa: F401
        return None
    except ImportError as exc:
        return (f"neither cuda-python ({first}) nor pycuda ({exc}) is installed; "
                "TensorRT needs one for device memory: `pip install cuda-python`")


class CudaPythonMemory:
    """The interface on cuda-python's runtime API; every call's error code is checked."""

    name = "cuda-python"

    def __init__(self) -> None:
        self.rt = import_cudart()
        self._ok = self.rt.cudaError_t.cudaSuccess
        try:
            self._call("cudaFree(0)", self.rt.cudaFree(0))  # initialises the primary context: driver errors now
        except CudaError as exc:
            fix = version_mismatch_fix(*self._raw_versions())
            raise CudaError(f"{exc}; {fix}" if fix else str(exc)) from None
        self.supports_graphs = all(hasattr(self.rt, n) for n in ("cudaStreamBeginCapture", "cudaGraphLaunch"))

    def _raw_versions(self) -> tuple[int | None, int | None]:
        """(CUDA version these bindings are built for, CUDA version the driver supports) as integers."""
        def query(fn_name: str) -> int | None:
            fn = getattr(self.rt, fn_name, None)
            try:
                err, value = fn()  # type: ignore[misc]
            except Exception:  # a missing or broken query only loses the diagnosis, not the error itself
                return None
            return int(value) if err == self._ok else None

        return query("cudaRuntimeGetVersion"), query("cudaDriverGetVersion")

    def versions(self) -> dict[str, str | None]:
        """{"built_for": "13.0", "driver": "12.6"}: cuda-python's compiled-in CUDA and the driver's."""
        built, driver = self._raw_versions()
        return {"built_for": cuda_version_text(built), "driver": cuda_version_text(driver)}

    def device_properties(self) -> dict[str, Any]:
        """GPU 0: name, compute capability, SM count, total memory in bytes."""
        prop = self._call("cudaGetDeviceProperties", self.rt.cudaGetDeviceProperties(0))
        name = prop.name.split(b"\0", 1)[0].decode() if isinstance(prop.name, bytes) else str(prop.name)
        return {"name": name.strip(), "compute_capability": f"{prop.major}.{prop.minor}",
                "sm_count": int(prop.multiProcessorCount), "total_memory": int(prop.totalGlobalMem)}

    def clear_error(self) -> str | None:
        """Read and reset the runtime's last error (as trtexec does after a failed graph capture)."""
        result = self.rt.cudaGetLastError()
        err = result[0] if isinstance(result, tuple) else result
        return None if err == self._ok else self._error_name(err)

    def _error_name(self, err: Any) -> str:
        if hasattr(self.rt, "cudaGetErrorName"):
            name = self.rt.cudaGetErrorName(err)[1]
            return name.decode() if isinstance(name, bytes) else str(name)
        return str(err)

    def _call(self, what: str, result: Any) -> Any:
        """cuda-python returns (err, *values); raise on err, unwrap one value."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._ok:
            raise CudaError(f"{what} failed: {self._error_name(err)}")
        return values[0] if len(values) == 1 else tuple(values) or None

    def malloc(self, nbytes: int) -> DeviceBuffer:
        """Device memory of `nbytes` (at least one byte, so empty tensors still get an address)."""
        ptr = self._call("cudaMalloc", self.rt.cudaMalloc(max(1, nbytes)))
        return DeviceBuffer(int(ptr), nbytes, ptr)

    def free(self, buffer: DeviceBuffer) -> None:
        """Release device memory."""
        self._call("cudaFree", self.rt.cudaFree(buffer.ptr))

    def pinned_empty(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        """A numpy array in page-locked host memory (required for truly asynchronous copies)."""
        dtype = np.dtype(dtype)
        used = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        nbytes = max(1, used)
        ptr = int(self._call("cudaMallocHost", self.rt.cudaMallocHost(nbytes)))
        raw = np.ctypeslib.as_array((ctypes.c_byte * nbytes).from_address(ptr))
        return raw[:used].view(dtype).reshape(tuple(shape))

    def free_pinned(self, array: np.ndarray) -> None:
        """Release a pinned array from `pinned_empty` (the array must not be used afterwards)."""
        self._call("cudaFreeHost", self.rt.cudaFreeHost(array.ctypes.data))

    def create_stream(self) -> Any:
        """A non-blocking stream: it never synchronises with the legacy default stream."""
        flags = getattr(self.rt, "cudaStreamNonBlocking", 1)
        return self._call("cudaStreamCreateWithFlags", self.rt.cudaStreamCreateWithFlags(flags))

    def destroy_stream(self, stream: Any) -> None:
        """Release a stream."""
        self._call("cudaStreamDestroy", self.rt.cudaStreamDestroy(stream))

    def stream_handle(self, stream: Any) -> int:
        """The raw `cudaStream_t` value TensorRT's `execute_async_v3(stream_handle)` expects.

        `int(stream)` is the handle itself; `stream.getPtr()` would be the address of the Python
        object's storage for it, which TensorRT would take for a stream and crash on.
        """
        return int(stream)

    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Any) -> None:
        """Queue host -> device; `src` should be pinned and contiguous."""
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._call("cudaMemcpyAsync", self.rt.cudaMemcpyAsync(dst.ptr, src.ctypes.data, src.nbytes, kind, stream))

    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Any) -> None:
        """Queue device -> host into a pinned, contiguous array."""
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._call("cudaMemcpyAsync", self.rt.cudaMemcpyAsync(dst.ctypes.data, src.ptr, dst.nbytes, kind, stream))

    def synchronize(self, stream: Any) -> None:
        """Wait for everything queued on `stream`."""
        self._call("cudaStreamSynchronize", self.rt.cudaStreamSynchronize(stream))

    def create_event(self) -> Any:
        """A timing-capable event."""
        return self._call("cudaEventCreate", self.rt.cudaEventCreate())

    def record_event(self, event: Any, stream: Any) -> None:
        """Mark the current point of `stream`."""
        self._call("cudaEventRecord", self.rt.cudaEventRecord(event, stream))

    def synchronize_event(self, event: Any) -> None:
        """Wait until the event has happened."""
        self._call("cudaEventSynchronize", self.rt.cudaEventSynchronize(event))

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """GPU time between two recorded events."""
        return float(self._call("cudaEventElapsedTime", self.rt.cudaEventElapsedTime(start, end)))

    def destroy_event(self, event: Any) -> None:
        """Release an event."""
        self._call("cudaEventDestroy", self.rt.cudaEventDestroy(event))

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes; on Jetson this is the shared system memory."""
        free, total = self._call("cudaMemGetInfo", self.rt.cudaMemGetInfo())
        return int(free), int(total)

    def begin_capture(self, stream: Any) -> None:
        """Start recording `stream` into a graph (thread-local mode: other threads may keep using CUDA)."""
        mode = self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        self._call("cudaStreamBeginCapture", self.rt.cudaStreamBeginCapture(stream, mode))

    def end_capture(self, stream: Any) -> Any:
        """Stop recording and instantiate; returns (graph, executable graph)."""
        graph = self._call("cudaStreamEndCapture", self.rt.cudaStreamEndCapture(stream))
        try:
            if hasattr(self.rt, "cudaGraphInstantiateWithFlags"):
                exe = self._call("cudaGraphInstantiate", self.rt.cudaGraphInstantiateWithFlags(graph, 0))
            else:
                exe = self._call("cudaGraphInstantiate", self.rt.cudaGraphInstantiate(graph, 0))
        except CudaError:
            self.rt.cudaGraphDestroy(graph)  # the captured graph is ours until an executable owns a copy of it
            raise
        return graph, exe

    def launch_graph(self, graph: Any, stream: Any) -> None:
        """Replay a captured graph on `stream`."""
        self._call("cudaGraphLaunch", self.rt.cudaGraphLaunch(graph[1], stream))

    def destroy_graph(self, graph: Any) -> None:
        """Release a graph from `end_capture`."""
        self._call("cudaGraphExecDestroy", self.rt.cudaGraphExecDestroy(graph[1]))
        self._call("cudaGraphDestroy", self.rt.cudaGraphDestroy(graph[0]))

    def close(self) -> None:
        """Nothing to release: the runtime API owns the primary context."""


def open_implementation(name: str) -> CudaMemory:
    """Open one named implementation, raising its own error (ImportError, CudaError...): for the doctor."""
    return _open(name)


def _open(name: str) -> CudaMemory:
    if name == "cuda-python":
        return CudaPythonMemory()
    if name == "pycuda":
        from engines.cuda_mem_pycuda import PyCudaMemory

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
        except Exception as exc:  # report any failure mode (missing module, no driver, no GPU)
            out[name] = f"{type(exc).__name__}: {exc}"
    return out
