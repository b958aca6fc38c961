"""The CUDA memory interface (engines/cuda/base.py) on pycuda, for JetPack images without cuda-python.

pycuda's calls need a current context in the calling thread, while the agent loads engines in one
thread and runs them in another. So the device's *primary* context (the one the CUDA runtime, and
with it TensorRT, uses) is retained once and pushed around each call: both libraries then share it.

No CUDA graphs here: stream capture (`Stream.begin_capture`, graph instantiate/launch) exists only in
unmerged pycuda pull requests, not in any released pycuda, so this implementation never claims it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np

import pycuda.driver as cuda  # an ImportError here disables this implementation

from engines.cuda.base import CudaError, DeviceBuffer


class PyCudaMemory:
    """pycuda behind the CudaMemory interface; pycuda's errors become CudaError."""

    name = "pycuda"

    def __init__(self, device: int = 0) -> None:
        try:
            cuda.init()
            self._context = cuda.Device(device).retain_primary_context()
        except cuda.Error as exc:
            raise CudaError(f"pycuda cannot open GPU {device}: {exc}") from exc
        self._pinned: dict[int, Any] = {}
        self._device = device
        self.supports_graphs = False  # no released pycuda has stream capture (see the module docstring)

    def versions(self) -> dict[str, str | None]:
        """{"built_for": "12.2", "driver": "12.6"}: the CUDA pycuda was compiled against, and the driver's."""
        built = cuda.get_version()  # (major, minor, patch) of the CUDA headers pycuda was built with
        driver = cuda.get_driver_version()  # 12060
        return {"built_for": f"{built[0]}.{built[1]}", "driver": f"{driver // 1000}.{(driver % 1000) // 10}"}

    def device_properties(self) -> dict[str, Any]:
        """GPU `device`: name, compute capability, SM count, total memory in bytes."""
        dev = cuda.Device(self._device)
        major, minor = dev.compute_capability()
        return {"name": dev.name(), "compute_capability": f"{major}.{minor}",
                "sm_count": int(dev.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)),
                "total_memory": int(dev.total_memory())}

    @contextlib.contextmanager
    def _current(self, what: str) -> Iterator[None]:
        self._context.push()
        try:
            yield
        except cuda.Error as exc:
            raise CudaError(f"{what} failed: {exc}") from exc
        finally:
            cuda.Context.pop()

    def malloc(self, nbytes: int) -> DeviceBuffer:
        """Device memory of `nbytes` (at least one byte)."""
        with self._current("mem_alloc"):
            alloc = cuda.mem_alloc(max(1, nbytes))
        return DeviceBuffer(int(alloc), nbytes, alloc)

    def free(self, buffer: DeviceBuffer) -> None:
        """Release device memory."""
        with self._current("free"):
            buffer.handle.free()

    def pinned_empty(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        """A numpy array in page-locked host memory."""
        with self._current("pagelocked_empty"):
            array = cuda.pagelocked_empty(tuple(shape), np.dtype(dtype))
        self._pinned[array.ctypes.data] = array.base
        return array

    def free_pinned(self, array: np.ndarray) -> None:
        """Release a pinned array from `pinned_empty`."""
        base = self._pinned.pop(array.ctypes.data, None)
        if base is not None and hasattr(base, "free"):
            with self._current("free pinned"):
                base.free()

    def create_stream(self) -> Any:
        """A non-blocking stream (flag 1 = CU_STREAM_NON_BLOCKING)."""
        with self._current("Stream"):
            return cuda.Stream(flags=1)

    def destroy_stream(self, stream: Any) -> None:
        """pycuda frees a stream when its object goes; drop our reference."""
        del stream

    def stream_handle(self, stream: Any) -> int:
        """The raw CUstream value for TensorRT."""
        return int(stream.handle)

    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Any) -> None:
        """Queue host -> device."""
        with self._current("memcpy_htod_async"):
            cuda.memcpy_htod_async(dst.ptr, src, stream)

    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Any) -> None:
        """Queue device -> host."""
        with self._current("memcpy_dtoh_async"):
            cuda.memcpy_dtoh_async(dst, src.ptr, stream)

    def synchronize(self, stream: Any) -> None:
        """Wait for everything queued on `stream`."""
        with self._current("Stream.synchronize"):
            stream.synchronize()

    def create_event(self) -> Any:
        """A timing-capable event."""
        with self._current("Event"):
            return cuda.Event()

    def record_event(self, event: Any, stream: Any) -> None:
        """Mark the current point of `stream`."""
        with self._current("Event.record"):
            event.record(stream)

    def synchronize_event(self, event: Any) -> None:
        """Wait until the event has happened."""
        with self._current("Event.synchronize"):
            event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """GPU time between two recorded events."""
        with self._current("Event.time_since"):
            return float(end.time_since(start))

    def destroy_event(self, event: Any) -> None:
        """pycuda frees events with their objects."""
        del event

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes."""
        with self._current("mem_get_info"):
            free, total = cuda.mem_get_info()
        return int(free), int(total)

    def begin_capture(self, stream: Any) -> None:
        """Not available: `supports_graphs` is False, callers check it first."""
        raise CudaError("pycuda has no stream capture in any released version")

    def end_capture(self, stream: Any) -> Any:
        """Not available (see begin_capture)."""
        raise CudaError("pycuda has no stream capture in any released version")

    def launch_graph(self, graph: Any, stream: Any) -> None:
        """Not available (see begin_capture)."""
        raise CudaError("pycuda has no stream capture in any released version")

    def destroy_graph(self, graph: Any) -> None:
        """Nothing was ever captured."""

    def close(self) -> None:
        """Release our hold on the primary context."""
        with contextlib.suppress(cuda.Error):
            self._context.detach()
