"""TensorRT backend: a serialized plan, name-based I/O, `execute_async_v3` on a non-default stream.

`import tensorrt` is at module level on purpose: where it fails, the backend registry records the
reason ("tensorrt: disabled (No module named 'tensorrt')") and the agent runs on ONNX Runtime. The
same happens when neither cuda-python nor pycuda is installed (TensorRT alone cannot move tensors).

Per engine: one execution context, one non-blocking CUDA stream, a pinned host array and a device
buffer per I/O tensor (addresses bound once with `set_tensor_address`). With static shapes the
enqueue is captured into a CUDA graph after a first plain run, replayed thereafter, and kept only if
its outputs match the plain run's bit for bit; otherwise the reason is in `describe()`. A failed
capture leaves a sticky "last error" in the CUDA runtime; it is read and cleared at once (as trtexec
does), so the plain path that follows does not inherit it. TensorRT 8.5 is never captured (it fails).

NMS: a plan whose sidecar says `report.nms.where = "engine"` holds EfficientNMS_TRT (engines.nms_graph);
`TrtEngine.nms` says so (checked against the engine's outputs, inferred from them without a sidecar), and the
runtime decodes its four outputs as the yolo layout `efficient_nms`. TensorRT's bundled plugins are registered
(once per process) before every deserialize: without that a plan holding the plugin does not deserialize.

DLA: a plan built for `dla:N` (`EngineOptions.dla_core`, else the plan's sidecar `<plan>.json`) is
deserialized with `Runtime.DLA_core = N` (TensorRT's default is core 0); a core this TensorRT does not
report is ENGINE_DLA_UNAVAILABLE.

Batching: a plan built with a batch profile (min 1, opt = max = `max_size`) and loaded with
`EngineOptions.max_batch > 1` gets buffers for the largest batch; `infer` on `[N, C, H, W]` uses the first
N rows. With CUDA graphs on, each batch size in use gets its own execution context, created on its first
use with its input shape set once and the shared buffers bound, and its own graph captured from that
context. A captured graph holds the shapes its context had; TensorRT needs an enqueue after every input
shape change, and a graph replayed after its context's shape changed computes with stale state (TensorRT
developer guide, "CUDA Graphs"; trtexec captures once per context and never changes its shapes:
samples/common/sampleInference.cpp at v10.3.0). So no context's shape changes after its capture. The cost
is one context's activation memory per batch size in use (at most max_batch of them). Without graphs one
context serves every size: its shape is set when N changes and the plain enqueue that follows is valid.

This module imports when tensorrt and a CUDA binding import; whether they really run on this device
(driver, GPU, memory) is `engines.doctor`'s question, which `auto` backend selection asks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import tensorrt as trt

from engines import cuda as cuda_mem
from engines.backends import BACKENDS
from engines.backends.base import EngineOptions, TensorSpec
from engines.backends.tensorrt_compat import (graph_capture_blocker, numpy_dtype, register_plugins, select_dla_core,
                                              shared_logger, sidecar_dla_core)
from engines.cuda import CudaError, CudaMemory, DeviceBuffer, open_cuda_memory
from engines.errors import BatchSizeError, InferenceError, ModelError
from engines.nms_graph import engine_nms, sidecar_nms

log = logging.getLogger(__name__)
if (_missing := cuda_mem.missing_bindings()) is not None:
    raise ImportError(_missing)  # disables the backend with this reason; "auto" then picks ONNX Runtime


class _Binding:
    """One I/O tensor: name, shape, dtype, pinned host array and device buffer."""

    def __init__(self, cuda: CudaMemory, name: str, shape: tuple[int, ...], dtype: np.dtype, is_input: bool) -> None:
        self.name, self.shape, self.dtype, self.is_input = name, shape, dtype, is_input
        self.host = cuda.pinned_empty(shape, dtype)
        self.host.fill(0)
        self.device: DeviceBuffer = cuda.malloc(self.host.nbytes)
        self.active: np.ndarray = self.host  # the rows of the current batch (all of it at batch max)

    def spec(self, batched: bool = False) -> TensorSpec:
        """The tensor as the Engine protocol describes it (batch dimension None when it varies)."""
        if batched:
            return TensorSpec(self.name, (None, *self.shape[1:]), str(self.dtype), ("batch",) + (None,) * (len(self.shape) - 1))
        return TensorSpec(self.name, self.shape, str(self.dtype))

    def set_active(self, shape: tuple[int, ...]) -> None:
        """View the leading part of the buffers as `shape` (a smaller batch of the same tensor)."""
        count = int(np.prod(shape)) if shape else 1
        self.active = self.host.reshape(-1)[:count].reshape(shape)

    def release(self, cuda: CudaMemory) -> None:
        """Free both buffers."""
        cuda.free(self.device)
        cuda.free_pinned(self.host)


class TrtEngine:
    """A deserialized TensorRT engine with its context, stream, buffers and optional CUDA graph."""

    backend = "tensorrt"

    def __init__(self, plan: bytes, path: Path, options: EngineOptions, cuda_graphs: bool = True) -> None:
        self.path, self.precision = path, options.precision
        self._bindings: list[_Binding] = []
        self._graph: Any = None
        self._graphs: dict[int, Any] = {}  # batch size -> captured graph
        self._contexts: dict[int, Any] = {}  # batch size -> its own execution context (batched, with CUDA graphs)
        self.graph_statuses: dict[int, str] = {}
        self.max_batch = 1
        self._batch = 1
        self.dla_core: int | None = None  # from the plan's sidecar; None: the GPU
        self.nms = "host"  # "engine" where the plan holds EfficientNMS_TRT (its sidecar's report.nms)
        self._cuda_graphs = cuda_graphs
        self._engine: Any = None
        self._context: Any = None
        self._stream: Any = None
        self.cuda: CudaMemory | None = open_cuda_memory()
        self.cuda_name = self.cuda.name
        try:
            self._setup(plan, options, cuda_graphs)
        except BaseException:
            self.close()  # a half-built engine must not leak device memory or the context
            raise

    def _live_cuda(self) -> CudaMemory:
        """The CUDA memory of an engine not closed yet."""
        if self.cuda is None:
            raise InferenceError(f"{self.path.name}: engine is closed")
        return self.cuda

    def _setup(self, plan: bytes, options: EngineOptions, cuda_graphs: bool) -> None:
        self._runtime = trt.Runtime(shared_logger(trt))  # one logger per process: see tensorrt_compat
        self.dla_core = options.dla_core if options.dla_core is not None else sidecar_dla_core(self.path)
        sidecar = sidecar_nms(self.path)
        if self.dla_core is not None:  # a dla:N plan runs on the Runtime's core (TensorRT's default: 0)
            select_dla_core(trt, self._runtime, self.dla_core, self.path.name)
        plugins = register_plugins(trt)  # a plan holding EfficientNMS_TRT finds its creator only after this
        self._engine = self._runtime.deserialize_cuda_engine(plan)
        if self._engine is None:
            held = f"; it holds EfficientNMS_TRT ({plugins})" if sidecar == "engine" else ""
            raise ModelError(f"{self.path.name}: TensorRT {trt.__version__} cannot deserialize this plan (built by "
                             f"another TensorRT version or for another GPU{held})", code="ENGINE_INCOMPATIBLE")
        self._context = self._engine.create_execution_context()
        cuda = self._live_cuda()
        self._stream = cuda.create_stream()
        self._handle = cuda.stream_handle(self._stream)
        self._bind(options.static_shapes, options.max_batch)
        self.nms = engine_nms(self.path, [b.name for b in self._bindings if not b.is_input])
        batched = self.max_batch > 1
        self.inputs = [b.spec(batched) for b in self._bindings if b.is_input]
        self.outputs = [b.spec(batched) for b in self._bindings if not b.is_input]
        if batched:
            if self._per_size_contexts():
                self._contexts[self.max_batch] = self._context  # _bind set it up for the largest batch
            self._set_batch(1)
        self.graph_status = self._graph_for_batch()

    def _per_size_contexts(self) -> bool:
        """True when each batch size gets its own context: batched and graphs can be captured here."""
        return (self.max_batch > 1 and self._cuda_graphs and self.cuda is not None and self.cuda.supports_graphs
                and not graph_capture_blocker(trt))

    def _bind(self, static_shapes: dict[str, tuple[int, ...]], max_batch: int = 1) -> None:
        """Resolve every I/O tensor's shape (dynamic inputs from `static_shapes` or profile 0's opt); with
        `max_batch` > 1 and a dynamic batch in the profile, buffers are sized for the largest batch."""
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        is_input = {n: self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.max_batch = self._profile_max_batch([n for n in names if is_input[n]], max_batch)
        self._base_shapes: dict[str, tuple[int, ...]] = {}
        for name in (n for n in names if is_input[n]):
            shape = tuple(self._engine.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                shape = tuple(static_shapes.get(name) or self._engine.get_tensor_profile_shape(name, 0)[1])
                self._base_shapes[name] = shape
                if self.max_batch > 1:
                    shape = (self.max_batch, *shape[1:])
                if not self._context.set_input_shape(name, shape):
                    raise ModelError(f"{self.path.name}: input {name} rejects shape {list(shape)}",
                                     code="MODEL_SHAPE_MISMATCH")
        for name in names:
            shape = tuple(self._context.get_tensor_shape(name))
            dtype = numpy_dtype(self._engine.get_tensor_dtype(name), name)  # not trt.nptype: see tensorrt_compat
            self._bindings.append(_Binding(self._live_cuda(), name, shape, dtype, is_input[name]))
            self._context.set_tensor_address(name, self._bindings[-1].device.ptr)

    def _profile_max_batch(self, inputs: list[str], wanted: int) -> int:
        """`wanted`, capped by profile 0's max batch of every input whose batch dimension is dynamic; 1 when
        any input has a fixed batch (a plan built from an export with batch fixed to 1)."""
        if wanted <= 1:
            return 1
        limit = wanted
        for name in inputs:
            if tuple(self._engine.get_tensor_shape(name))[:1] != (-1,):
                return 1
            limit = min(limit, int(tuple(self._engine.get_tensor_profile_shape(name, 0)[2])[0]))
        return max(1, limit)

    def _set_batch(self, n: int) -> None:
        """The context for a batch of `n` (its own, or the one context with its shapes set to `n`); the
        bindings then view that many rows."""
        if self._per_size_contexts():
            context = self._contexts.get(n)
            if context is None:
                context = self._engine.create_execution_context()
                if context is None:  # TensorRT returns None when it cannot allocate the context's memory
                    raise InferenceError(f"{self.path.name}: no execution context for a batch of {n} "
                                         "(out of device memory?)")
                self._shape_context(context, n)
                for b in self._bindings:  # every size reads and writes the same buffers
                    context.set_tensor_address(b.name, b.device.ptr)
                self._contexts[n] = context
        else:
            context = self._context
            self._shape_context(context, n)
        for b in self._bindings:
            b.set_active(tuple(context.get_tensor_shape(b.name)))
        self._context = context
        self._batch = n
        self._graph = self._graphs.get(n)

    def _shape_context(self, context: Any, n: int) -> None:
        for name, base in self._base_shapes.items():
            if not context.set_input_shape(name, (n, *base[1:])):
                raise BatchSizeError(f"{self.path.name}: input {name} rejects a batch of {n}")

    def _graph_for_batch(self) -> str:
        """Capture (once) the graph of the current batch size; the status of that size."""
        n = self._batch
        if n not in self.graph_statuses:
            status = self._capture_graph() if self._cuda_graphs else "disabled by configuration"
            self.graph_statuses[n] = status
            if self._graph is not None:
                self._graphs[n] = self._graph
        return self.graph_statuses[n]

    def _enqueue(self) -> None:
        if self._graph is not None:
            self._live_cuda().launch_graph(self._graph, self._stream)
        elif not self._context.execute_async_v3(self._handle):
            raise InferenceError(f"{self.path.name}: execute_async_v3 failed (see the TensorRT log)")

    def _run(self) -> list[np.ndarray]:
        """Inputs are already in the pinned arrays: copy in, enqueue, copy out, wait."""
        cuda = self._live_cuda()
        for b in self._bindings:
            if b.is_input:
                cuda.copy_htod_async(b.device, b.active, self._stream)
        self._enqueue()
        outputs = [b for b in self._bindings if not b.is_input]
        for b in outputs:
            cuda.copy_dtoh_async(b.active, b.device, self._stream)
        cuda.synchronize(self._stream)
        return [b.active.copy() for b in outputs]

    def _capture_graph(self) -> str:
        """Capture `execute_async_v3` into a CUDA graph; keep it only if it reproduces a plain run."""
        cuda = self._live_cuda()
        if not cuda.supports_graphs:
            return f"{cuda.name} has no stream capture"
        blocker = graph_capture_blocker(trt)
        if blocker:
            return blocker
        try:
            expected = self._run()  # also the required first enqueue after shapes are set
            cuda.begin_capture(self._stream)
            try:
                ok = self._context.execute_async_v3(self._handle)
            finally:
                graph = cuda.end_capture(self._stream)
            if not ok:
                cuda.destroy_graph(graph)
                return "execute_async_v3 failed during capture" + self._clear_cuda_error()
            self._graph = graph
            if not all(np.array_equal(a, b) for a, b in zip(expected, self._run())):
                self._drop_graph()
                return "graph replay differs from a plain run"
        except (CudaError, InferenceError) as exc:
            self._drop_graph()
            return f"capture failed: {exc}" + self._clear_cuda_error()
        return "captured"

    def _clear_cuda_error(self) -> str:
        """Reset the runtime's sticky last error after a failed capture; text for the graph status."""
        clear = getattr(self.cuda, "clear_error", None)
        if clear is None:
            return ""
        try:
            cleared = clear()
        except CudaError as exc:
            log.warning("%s: clearing the CUDA error after a failed capture: %s", self.path.name, exc)
            return f" (CUDA error not cleared: {exc})"
        return f" (cleared CUDA error {cleared})" if cleared else ""

    def _drop_graph(self) -> None:
        if self._graph is not None:
            graph, self._graph = self._graph, None
            self._graphs = {n: g for n, g in self._graphs.items() if g is not graph}
            self._destroy(graph)

    def _drop_all_graphs(self) -> None:
        self._graph = None
        graphs, self._graphs = list(self._graphs.values()), {}
        for graph in graphs:
            self._destroy(graph)

    def _destroy(self, graph: Any) -> None:
        try:
            self._live_cuda().destroy_graph(graph)
        except CudaError as exc:
            log.warning("%s: destroying CUDA graph: %s", self.path.name, exc)

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Copy feeds (a batch of 1..max_batch) into the pinned inputs, run, return copies of the outputs."""
        if self.cuda is None:
            raise InferenceError(f"{self.path.name}: engine is closed")
        if self.max_batch > 1:
            self._select_batch(feeds)
        for b in self._bindings:
            if not b.is_input:
                continue
            try:
                np.copyto(b.active, feeds[b.name], casting="same_kind")
            except (KeyError, ValueError, TypeError) as exc:
                raise InferenceError(f"{self.path.name}: input {b.name} {list(b.active.shape)} {b.dtype}: {exc}") from exc
        try:
            if self.max_batch > 1:
                self._graph_for_batch()
            return self._run()
        except CudaError as exc:
            raise InferenceError(f"{self.path.name}: {exc}") from exc

    def _select_batch(self, feeds: dict[str, np.ndarray]) -> None:
        """Switch the input shapes to the feeds' batch size when it changed (1..max_batch)."""
        first = next((b for b in self._bindings if b.is_input), None)
        value = feeds.get(first.name) if first is not None else None
        n = int(value.shape[0]) if value is not None and bool(getattr(value, "ndim", 0)) else self._batch
        if not 1 <= n <= self.max_batch:
            raise BatchSizeError(f"{self.path.name}: a batch of {n}; this engine takes 1..{self.max_batch}")
        if n != self._batch:
            self._set_batch(n)

    def describe(self) -> dict[str, Any]:
        """Engine, CUDA and graph details for status and bench."""
        return {
            "backend": self.backend, "backend_version": trt.__version__, "precision": self.precision,
            "cuda_memory": self.cuda_name, "cuda_graph": self._graph is not None, "cuda_graph_status": self.graph_status,
            "max_batch": self.max_batch, "cuda_graphs": {str(n): s for n, s in sorted(self.graph_statuses.items())},
            "contexts": sorted(self._contexts) or [self._batch],
            "device": "gpu" if self.dla_core is None else f"dla:{self.dla_core}", "nms": self.nms,
            "inputs": [i.to_dict() for i in self.inputs], "outputs": [o.to_dict() for o in self.outputs],
        }

    def close(self) -> None:
        """Free the graph, buffers and stream, then the context and engine (idempotent)."""
        if self.cuda is None:
            return
        self._drop_all_graphs()
        for b in self._bindings:
            b.release(self.cuda)
        self._bindings = []
        if self._stream is not None:
            self.cuda.destroy_stream(self._stream)
        self._contexts = {}
        self._context = self._engine = self._stream = None  # contexts before the engine, as TensorRT requires
        self.cuda.close()
        self.cuda = None


@BACKENDS.register("tensorrt")
class TensorRTBackend:
    """Loads plan files; a bare `.onnx` is built in process first (slow: use engines.build.provisioning)."""

    name = "tensorrt"

    def __init__(self, cuda_graphs: bool = True) -> None:
        self.cuda_graphs = cuda_graphs

    def version(self) -> str:
        """TensorRT version string (part of the engine cache key)."""
        return str(trt.__version__)

    def load(self, model_path: Path, options: EngineOptions) -> TrtEngine:
        """Deserialize a plan; an unloadable plan is ModelError code ENGINE_INCOMPATIBLE."""
        model_path = Path(model_path)
        if model_path.suffix == ".onnx":
            raise ModelError(f"{model_path.name}: TensorRT runs built plans, not ONNX; build one first "
                             "(engines.build.provision, `edge-agent engines build`), which also caches it",
                             code="USAGE")
        return TrtEngine(model_path.read_bytes(), model_path, options, self.cuda_graphs)
