"""The CUDA half of tests/fake_nvidia.py: host memory posing as device memory, with streams, events and graph
capture modelled as the CUDA runtime documents them (see FakeCudaMemory)."""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable

import numpy as np

from engines.cuda import CudaError, DeviceBuffer


class FakeCudaMemory:
    """Host memory posing as device memory; stream work runs at once, or is recorded while capturing.

    A captured graph remembers the shape generation of every TensorRT context enqueued into it; replayed
    after one of those contexts changed its input shapes, it computes with stale state, as the real one
    does (silently: the outputs are garbage, and `stale_replays` counts it). `live()` counts what is
    allocated and not freed (buffers, pinned arrays, streams, events, graphs), for leak checks.

    Capture follows the CUDA runtime (cudaStreamBeginCapture with cudaStreamCaptureModeThreadLocal, the mode
    engines/cuda/base.py uses; CUDA Programming Guide, "Prohibited and Unhandled Operations"): synchronizing
    the capturing stream or allocating while capturing is an error (cudaErrorStreamCaptureUnsupported) that
    invalidates the capture, and the cudaStreamEndCapture after it fails (cudaErrorStreamCaptureInvalidated)
    with no graph.

    `empty_capture`: a capture records none of the work enqueued into it (an enqueue that returned True but put
    nothing on the stream): its graph replays as a no-op, leaving the device outputs as they were."""

    name = "fake"

    def __init__(self, supports_graphs: bool = True, corrupt_replay: bool = False, empty_capture: bool = False) -> None:
        self.supports_graphs = supports_graphs
        self.corrupt_replay = corrupt_replay
        self.empty_capture = empty_capture
        self._buffers: dict[int, Any] = {}
        self._capture: list[Callable[[], None]] | None = None
        self._invalidated = False
        self._captured_contexts: list[tuple[Any, int]] = []
        self._pinned: dict[int, np.ndarray] = {}
        self._streams: set[int] = set()
        self._events: set[int] = set()
        self._graphs: set[int] = set()
        self.launches = 0
        self.stale_replays = 0
        self.closed = False

    @property
    def capturing(self) -> bool:
        return self._capture is not None

    def enqueue(self, op: Callable[[], None], context: Any = None) -> None:
        """Run now, or record into the graph being captured (with the enqueuing context's shape generation)."""
        if self._capture is not None:
            if self.empty_capture:
                return
            self._capture.append(op)
            if context is not None:
                self._captured_contexts.append((context, context._generation))
        else:
            op()

    def live(self) -> dict[str, int]:
        """What is allocated and not released, by kind (all zero after a clean close)."""
        return {"buffers": len(self._buffers), "pinned": len(self._pinned), "streams": len(self._streams),
                "events": len(self._events), "graphs": len(self._graphs)}

    def _illegal_during_capture(self, call: str) -> None:
        if self._capture is not None:
            self._invalidated = True
            raise CudaError(f"{call} failed: cudaErrorStreamCaptureUnsupported")

    def malloc(self, nbytes: int) -> DeviceBuffer:
        self._illegal_during_capture("cudaMalloc")
        if nbytes > 1 << 40:
            raise CudaError("cudaMalloc failed: cudaErrorMemoryAllocation")
        buf = ctypes.create_string_buffer(max(1, nbytes))
        self._buffers[ctypes.addressof(buf)] = buf
        return DeviceBuffer(ctypes.addressof(buf), nbytes, buf)

    def free(self, buffer: DeviceBuffer) -> None:
        del self._buffers[buffer.ptr]

    def pinned_empty(self, shape: Any, dtype: Any) -> np.ndarray:
        array = np.zeros(tuple(shape), np.dtype(dtype))
        self._pinned[id(array)] = array
        return array

    def free_pinned(self, array: np.ndarray) -> None:
        del self._pinned[id(array)]

    def create_stream(self) -> Any:
        stream = object()
        self._streams.add(id(stream))
        return stream

    def destroy_stream(self, stream: Any) -> None:
        self._streams.remove(id(stream))

    def stream_handle(self, stream: Any) -> int:
        return id(stream)

    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Any) -> None:
        self.enqueue(lambda: ctypes.memmove(dst.ptr, src.ctypes.data, src.nbytes))

    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Any) -> None:
        self.enqueue(lambda: ctypes.memmove(dst.ctypes.data, src.ptr, dst.nbytes))

    def synchronize(self, stream: Any) -> None:
        self._illegal_during_capture("cudaStreamSynchronize")

    def create_event(self) -> Any:
        event = [0.0]
        self._events.add(id(event))
        return event

    def record_event(self, event: Any, stream: Any) -> None:
        event[0] = time.perf_counter()

    def synchronize_event(self, event: Any) -> None:
        pass

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end[0] - start[0]) * 1e3

    def destroy_event(self, event: Any) -> None:
        self._events.remove(id(event))

    def mem_get_info(self) -> tuple[int, int]:
        return 6 << 30, 8 << 30

    def begin_capture(self, stream: Any) -> None:
        self._capture, self._captured_contexts, self._invalidated = [], [], False

    def end_capture(self, stream: Any) -> Any:
        ops, self._capture = self._capture or [], None
        if self._invalidated:
            self._invalidated = False
            raise CudaError("cudaStreamEndCapture failed: cudaErrorStreamCaptureInvalidated")
        graph = ("graph", ops, tuple(self._captured_contexts))
        self._graphs.add(id(graph))
        return graph

    def launch_graph(self, graph: Any, stream: Any) -> None:
        assert id(graph) in self._graphs, "replay of a destroyed graph"
        self.launches += 1
        for op in graph[1]:
            op()
        stale = any(context._generation != generation for context, generation in graph[2])
        self.stale_replays += int(stale)
        if self.corrupt_replay or stale:
            for buf in self._buffers.values():
                ctypes.memset(buf, 0x7F, 4)

    def destroy_graph(self, graph: Any) -> None:
        self._graphs.remove(id(graph))

    def close(self) -> None:
        self.closed = True
