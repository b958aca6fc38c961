"""The CUDA memory interface (engines/cuda/base.py) on cuda-python's runtime API: the first implementation tried."""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, Sequence

import numpy as np

from engines.cuda.base import CudaError, DeviceBuffer, cuda_version_text, import_cudart, version_mismatch_fix

log = logging.getLogger(__name__)


SHARED_CUDART = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


def loaded_shared_cudarts() -> list[tuple[str, Any]]:
    """The shared CUDA runtimes already loaded in this process (RTLD_NOLOAD: none is loaded by asking)."""
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:  # not a POSIX dlopen: nothing to find this way
        return []
    found = []
    for name in SHARED_CUDART:
        try:
            found.append((name, ctypes.CDLL(name, mode=noload | os.RTLD_LAZY)))
        except OSError:  # not loaded (or not present)
            continue
    return found


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
                err, value = fn()  # type: ignore[misc]  # None on bindings without it: the TypeError is caught
            except Exception:  # noqa: BLE001 - a missing or broken query only loses the diagnosis, not the error itself
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
        """Read and reset the CUDA runtime's last error after a failed graph capture, as trtexec does (its
        `cudaGetLastError()` after `endCaptureOnError`, samples/common/sampleInference.cpp at v10.3.0); what was
        cleared, or None.

        CUDA keeps the last error per runtime instance (and host thread), and a process can hold several. The
        one our capture calls went through is cuda-python's own: up to 12.8 a reimplementation of the runtime on
        the driver API with its own last error, from 12.9 a statically linked cudart, a private copy either way
        (cuda-bindings release notes). A shared `libcudart.so` that something else in the process loaded (the
        runtime TensorRT uses where it links the shared one) is another instance: it is reset too, but only if
        it is already loaded, never loaded here. A runtime linked statically inside libnvinfer is out of any
        binding's reach; TensorRT reports its own failures through `execute_async_v3`'s result."""
        result = self.rt.cudaGetLastError()
        err = result[0] if isinstance(result, tuple) else result
        cleared = [] if err == self._ok else [f"{self._error_name(err)} (cuda-python)"]
        for name, lib in loaded_shared_cudarts():
            code = int(lib.cudaGetLastError())
            if code:
                lib.cudaGetErrorName.restype = ctypes.c_char_p
                cleared.append(f"{(lib.cudaGetErrorName(code) or b'error %d' % code).decode()} ({name})")
        return "; ".join(cleared) or None

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
