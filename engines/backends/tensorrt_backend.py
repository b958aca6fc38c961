"""TensorRT backend: a serialized plan, name-based I/O, `execute_async_v3` on a non-default stream.

`import tensorrt` is at module level on purpose: where it fails, the backend registry records the
reason ("tensorrt: disabled (No module named 'tensorrt')") and the agent runs on ONNX Runtime. The
same happens when neither cuda-python nor pycuda is installed (TensorRT alone cannot move tensors).

Per engine: one non-blocking CUDA stream, a pinned host array and a device buffer per I/O tensor (addresses
bound once with `set_tensor_address`), and one block of activation memory (`activation_size`: the engine's
largest need over its profiles) that every execution context of the engine uses: contexts are created without
memory of their own (`tensorrt_compat.context_without_memory`) and given that block. They share it safely
because they only ever run one after another on the engine's one stream (NvInferRuntime.h: the memory is
in use from the enqueue until the work completes; another context using it *in parallel* is undefined).
`describe()` reports `activation_bytes` and `contexts_sharing_activation`.

CUDA graphs: with static shapes the enqueue is captured into a CUDA graph after a first plain run and
replayed thereafter, kept only if a replay into outputs first overwritten with a byte pattern reproduces the
plain run's outputs bit for bit: a capture that recorded nothing, or replays stale work, leaves the pattern
behind instead of passing on the plain run's leftovers. Otherwise the reason is in `describe()`. A failed
capture leaves a "last error" in the CUDA runtime (one per runtime instance and host thread): it is read and
cleared at once, as trtexec does, in cuda-python's own runtime (where our capture calls recorded it) and in a
shared libcudart already loaded in the process (CudaPythonMemory.clear_error). TensorRT 8.5 is never captured
(it fails).

NMS: a plan whose sidecar says `report.nms.where = "engine"` holds EfficientNMS_TRT (engines.postprocess.nms_graph);
`TrtEngine.nms` says so (checked against the engine's outputs, inferred from them without a sidecar), and the
runtime decodes its four outputs as the yolo layout `efficient_nms`. TensorRT's bundled plugins are registered
(once per process) before every deserialize: without that a plan holding the plugin does not deserialize.

DLA: a plan built for `dla:N` (`EngineOptions.dla_core`, else the plan's sidecar `<plan>.json`) is
deserialized with `Runtime.DLA_core = N` (TensorRT's default is core 0); a core this TensorRT does not
report is ENGINE_DLA_UNAVAILABLE.

Batching: a plan built with a batch profile (min 1, opt = max = `max_size`) and loaded with
`EngineOptions.max_batch > 1` gets buffers for the largest batch; `infer` on `[N, C, H, W]` uses the first
N rows. Two context schemes (`describe()["context_scheme"]`, with the reason):
- "per-size": with CUDA graphs on, each batch size in use gets its own execution context, created on its
  first use with its input shape set once and the shared buffers bound, and its own graph captured from that
  context. A captured graph holds the shapes its context had; TensorRT needs an enqueue after every input
  shape change, and a graph replayed after its context's shape changed computes with stale state (TensorRT
  developer guide, "CUDA Graphs"; trtexec captures once per context and never changes its shapes:
  samples/common/sampleInference.cpp at v10.3.0). So no context's shape changes after its capture. They
  share the one activation block, so a size costs a context's bookkeeping, not its activations.
- "single": one context serves every size; its shape is set when N changes and the plain enqueue that
  follows is valid; no graphs. Used without graphs (configuration, no stream capture, TensorRT 8.5), and
  where a new context gets no optimization profile: TensorRT 8.5 gives profile 0 only to the first context,
  8.6 only to a context while no other holds it; a second one starts at -1, rejects every shape and
  enqueue, and cannot take profile 0 (tensorrt_compat), and our plans have one profile. This is seen, not
  assumed from the version: the second context's `active_optimization_profile` is read when it is created
  (at load), and a -1 switches the engine to "single" (TensorRT 10+ gives every new context profile 0).
  (One profile per batch size at build time would give 8.6 per-size graphs too, at the cost of a build
  per profile; plans already cached would still need this fallback.)

This module imports when tensorrt and a CUDA binding import; whether they really run on this device
(driver, GPU, memory) is `engines.tools.doctor`'s question, which `auto` backend selection asks.
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
from engines.backends.tensorrt_compat import (activation_size, assign_device_memory, context_profile,
                                              context_without_memory, graph_capture_blocker, numpy_dtype,
                                              register_plugins, select_dla_core, shared_logger, sidecar_dla_core)
from engines.cuda import CudaError, CudaMemory, DeviceBuffer, open_cuda_memory
from kernel.errors import BatchSizeError, InferenceError, ModelError
from engines.postprocess.nms_graph import engine_nms, sidecar_nms

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
            return TensorSpec(
                self.name, (None, *self.shape[1:]), str(self.dtype), ("batch",) + (None,) * (len(self.shape) - 1)
            )
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
    """A deserialized TensorRT engine with its contexts, stream, buffers, activation block and CUDA graphs."""

    backend = "tensorrt"

    def __init__(self, plan: bytes, path: Path, options: EngineOptions, cuda_graphs: bool = True) -> None:
        self.path, self.precision = path, options.precision
        self._bindings: list[_Binding] = []
        self._graph: Any = None
        self._graphs: dict[int, Any] = {}  # batch size -> captured graph
        self._contexts: dict[int, Any] = {}  # batch size -> its own execution context (scheme "per-size")
        self._single_reason: str | None = None  # why a batched engine runs one context, when a new one got no profile
        self.graph_statuses: dict[int, str] = {}
        self.max_batch = 1
        self._batch = 1
        self.dla_core: int | None = None  # from the plan's sidecar; None: the GPU
        self.nms = "host"  # "engine" where the plan holds EfficientNMS_TRT (its sidecar's report.nms)
        self._cuda_graphs = cuda_graphs
        self._engine: Any = None
        self._context: Any = None
        self._stream: Any = None
        self._activation: DeviceBuffer | None = None  # the activation memory every context of this engine uses
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
        cuda = self._live_cuda()
        self._activation = cuda.malloc(activation_size(self._engine))
        self._context = self._new_context("the engine")
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

    def _new_context(self, purpose: str) -> Any:
        """An execution context on the engine's activation block (created without memory of its own)."""
        context = context_without_memory(trt, self._engine)
        if context is None:  # TensorRT returns None when it cannot create the context
            raise InferenceError(f"{self.path.name}: TensorRT {trt.__version__} gave no execution context for "
                                 f"{purpose} (out of memory? see the TensorRT log)")
        block = self._activation
        assert block is not None  # allocated before the first context
        assign_device_memory(context, block.ptr, block.nbytes)
        return context

    def _per_size_contexts(self) -> bool:
        """True when each batch size gets its own context: batched, graphs can be captured here, and a new
        context gets an optimization profile."""
        return (self.max_batch > 1 and self._cuda_graphs and self.cuda is not None and self.cuda.supports_graphs
                and not graph_capture_blocker(trt) and self._single_reason is None)

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
        context = self._context_for(n)
        for b in self._bindings:
            b.set_active(tuple(context.get_tensor_shape(b.name)))
        self._context = context
        self._batch = n
        self._graph = self._graphs.get(n)

    def _context_for(self, n: int) -> Any:
        """Scheme "per-size": the size's own context, made on its first use; "single": the one context, shaped."""
        if not self._per_size_contexts():
            self._shape_context(self._context, n)
            return self._context
        context = self._contexts.get(n)
        if context is None:
            context = self._new_context(f"a batch of {n}")
            if context_profile(context) < 0:
                return self._go_single(n)  # `context` holds nothing: it is released on return
            self._shape_context(context, n)
            for b in self._bindings:  # every size reads and writes the same buffers
                context.set_tensor_address(b.name, b.device.ptr)
            self._contexts[n] = context
        return context

    def _go_single(self, n: int) -> Any:
        """A new context got no optimization profile (TensorRT 8.5/8.6 with profile 0 taken): from now on the
        first context serves every batch size, shaped per batch, with plain enqueue."""
        self._single_reason = (f"TensorRT {trt.__version__} gives a second execution context no optimization "
                               "profile (active_optimization_profile -1: profile 0 belongs to the first, and the "
                               "plan has no other), so one context serves every batch size with plain enqueue")
        log.info("%s: %s", self.path.name, self._single_reason)
        first = self._contexts.get(self.max_batch, self._context)
        self._contexts = {}
        self._drop_all_graphs()  # a graph of `first` would replay stale once its shape changes
        self.graph_statuses = {}
        self._shape_context(first, n)
        return first

    def _shape_context(self, context: Any, n: int) -> None:
        for name, base in self._base_shapes.items():
            if not context.set_input_shape(name, (n, *base[1:])):
                raise BatchSizeError(f"{self.path.name}: input {name} rejects a batch of {n}")

    def _graph_for_batch(self) -> str:
        """Capture (once) the graph of the current batch size; the status of that size."""
        n = self._batch
        if n not in self.graph_statuses:
            if self._single_reason is not None:
                status = f"not captured: {self._single_reason}"
            else:
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

    def _run(self, poison: list[int] | None = None) -> list[np.ndarray]:
        """Inputs are already in the pinned arrays: copy in, enqueue, copy out, wait. `poison`: one byte per
        output that its device buffer is filled with first (graph verification)."""
        cuda = self._live_cuda()
        outputs = [b for b in self._bindings if not b.is_input]
        for b in self._bindings:
            if b.is_input:
                cuda.copy_htod_async(b.device, b.active, self._stream)
        for b, byte in zip(outputs, poison or ()):
            b.active.reshape(-1).view(np.uint8).fill(byte)
            cuda.copy_htod_async(b.device, b.active, self._stream)
        self._enqueue()
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
            if not self._replay_matches(expected):
                self._drop_graph()
                return "graph replay differs from a plain run"
        except (CudaError, InferenceError) as exc:
            self._drop_graph()
            return f"capture failed: {exc}" + self._clear_cuda_error()
        return "captured"

    def _replay_matches(self, expected: list[np.ndarray]) -> bool:
        """Replay the new graph into outputs overwritten first, and compare bit for bit with the plain run. The
        plain run's result is still in the device outputs: a graph that computes nothing (an empty or stale
        capture) would pass on those leftovers; it cannot pass on the pattern."""
        replayed = self._run([_poison_byte(a) for a in expected])
        return all(a.tobytes() == b.tobytes() for a, b in zip(expected, replayed))

    def _clear_cuda_error(self) -> str:
        """Reset the last error a failed capture left in the runtimes we can reach (CudaPythonMemory.clear_error
        says which); text for the status."""
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
                raise InferenceError(
                    f"{self.path.name}: input {b.name} {list(b.active.shape)} {b.dtype}: {exc}"
                ) from exc
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

    def _scheme(self) -> tuple[str, str]:
        """("per-size" | "single", why) for describe()."""
        if self._per_size_contexts():
            return "per-size", "a context per batch size in use, each with its own CUDA graph"
        if self.max_batch == 1:
            return "single", "batch 1"
        why = self._single_reason or ("CUDA graphs are off or cannot be captured here, so nothing needs a "
                                      "context's shape to stay fixed")
        return "single", f"one context shaped per batch: {why}"

    def describe(self) -> dict[str, Any]:
        """Engine, CUDA, context and graph details for status and bench."""
        scheme, why = self._scheme()
        return {
            "backend": self.backend, "backend_version": trt.__version__, "precision": self.precision,
            "cuda_memory": self.cuda_name, "cuda_graph": self._graph is not None,
            "cuda_graph_status": self.graph_status, "max_batch": self.max_batch,
            "cuda_graphs": {str(n): s for n, s in sorted(self.graph_statuses.items())},
            "contexts": sorted(self._contexts) or [self._batch],
            "context_scheme": scheme, "context_scheme_reason": why,
            "activation_bytes": self._activation.nbytes if self._activation is not None else 0,
            "contexts_sharing_activation": len(self._contexts) or int(self._context is not None),
            "device": "gpu" if self.dla_core is None else f"dla:{self.dla_core}", "nms": self.nms,
            "inputs": [i.to_dict() for i in self.inputs], "outputs": [o.to_dict() for o in self.outputs],
        }

    def close(self) -> None:
        """Free the graphs, buffers and stream, then the contexts and engine, then their activation block
        (idempotent)."""
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
        if self._activation is not None:  # no context is left to use it
            self.cuda.free(self._activation)
            self._activation = None
        self.cuda.close()
        self.cuda = None


def _poison_byte(expected: np.ndarray) -> int:
    """A byte that does not fill `expected` entirely, so a replay that wrote nothing cannot match it."""
    flat = expected.reshape(-1).view(np.uint8)
    return 0x5A if flat.size and bool(np.all(flat == 0xA5)) else 0xA5


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
