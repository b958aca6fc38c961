"""The CUDA memory interface (engines/cuda_mem.py) on pycuda, for JetPack images without cuda-python.

pycuda's calls need a current context in the calling thread, while the agent loads engines in one
thread and runs them in another. So the device's *primary* context (the one the CUDA runtime, and
with it TensorRT, uses) is retained once and pushed around each call: both libraries then share it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np

import pycuda.driver as cuda  # noqa: E402  (an ImportError here disables this implementation)

from engines.cuda_mem import CudaError, DeviceBuffer


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
        # Stream capture arrived in pycuda 2022.1; older releases simply run without CUDA graphs.
        self.supports_graphs = hasattr(cuda.Stream, "begin_capture")

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
        """Start recording `stream` into a graph (thread-local mode)."""
        with self._current("Stream.begin_capture"):
            stream.begin_capture(cuda.capture_mode.THREAD_LOCAL)

    def end_capture(self, stream: Any) -> Any:
        """Stop recording; returns (graph, executable graph)."""
        with self._current("Stream.end_capture"):
            graph = stream.end_capture()
            return graph, graph.instantiate()

    def launch_graph(self, graph: Any, stream: Any) -> None:
        """Replay a captured graph on `stream`."""
        with self._current("GraphExec.launch"):
            graph[1].launch(stream)

    def destroy_graph(self, graph: Any) -> None:
        """pycuda frees graphs with their objects."""
        del graph

    def close(self) -> None:
        """Release our hold on the primary context."""
        with contextlib.suppress(cuda.Error):
            self._context.detach()
