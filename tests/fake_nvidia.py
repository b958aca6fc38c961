"""Recording stand-ins for the TensorRT Python API and for a CUDA memory implementation.

They let the TensorRT build logic and the TrtEngine runtime run on machines without a GPU, so their
control flow (feature detection across TensorRT 8.5 to 11, I/O binding, CUDA-graph capture and
fallback, error mapping) is tested everywhere. They model the API's *shape*, not its numerics: the
real libraries are exercised by the contract suites wherever they import.

The TensorRT stand-in exposes, per version, exactly the names NVIDIA's real bindings of that version
define: tests/data/tensorrt_api/<version>.json, generated from NVIDIA/TensorRT's pybind11 sources by
scripts/extract_tensorrt_api.py. A name outside that table raises AttributeError (so `hasattr`
feature detection sees what the real module would); a name in the table that this fake does not
model raises NotImplementedError, so a test never silently takes a branch the real module would not.

Behaviour the headers document is modelled per version where our code depends on it: the optimization profile
a new execution context gets and what a context without one refuses, contexts made without activation memory
(`_Engine`, `_Context`), a build that puts a dynamic profile on DLA (`_Builder`), and captures that record
nothing (`FakeCudaMemory(empty_capture=True)`). Subclasses change how contexts are made by overriding
`_Engine.create_execution_context` or `_Engine._new_context` (`create_execution_context_without_device_memory`
goes through both) and why an enqueue fails by overriding `_Context._enqueue_blocker`.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import json
import time
import types
import weakref
from pathlib import Path
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


# --- TensorRT: the real API of each version, from NVIDIA's binding sources --------------------

API_DIR = Path(__file__).resolve().parent / "data" / "tensorrt_api"


def api_versions() -> list[str]:
    """Every TensorRT version with a recorded API table, oldest first."""
    names = [p.stem for p in API_DIR.glob("*.json")]
    return sorted(names, key=lambda v: tuple(int(x) for x in v.split(".")))


class ApiTable:
    """One version's table: classes (with bases), enums (with values), module functions and attributes."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data, self.version = data, data["version"]
        self.classes: dict[str, dict[str, Any]] = data["classes"]
        self.enums: dict[str, dict[str, Any]] = data["enums"]

    @functools.lru_cache(maxsize=None)
    def members(self, cls: str) -> frozenset[str]:
        """A class's members including those inherited from its bound base classes."""
        entry = self.classes[cls]
        names = set(entry["members"])
        for base in entry["bases"]:
            names |= self.members(base)
        return frozenset(names)

    def module_names(self) -> set[str]:
        """Every top-level name of the real `tensorrt` module."""
        top = {n for n in (*self.classes, *self.enums) if "." not in n}
        return top | set(self.data["functions"]) | set(self.data["attributes"])

    def has(self, dotted: str) -> bool:
        """`Builder`, `BuilderFlag.FP16`, `IBuilderConfig.progress_monitor`, `ILogger.Severity.ERROR`."""
        head, _, member = dotted.rpartition(".")
        if not head:
            return dotted in self.module_names()
        if head in self.enums:
            return member in self.enums[head]["members"] or member in self.enums[head]["methods"]
        if head in self.classes:
            return member in self.members(head) or f"{head}.{member}" in self.enums
        return False


@functools.lru_cache(maxsize=None)
def load_api(version: str) -> ApiTable:
    """The table for `version` (a file name stem under tests/data/tensorrt_api/)."""
    return ApiTable(json.loads((API_DIR / f"{version}.json").read_text()))


class _Guarded:
    """Public attribute access checked against the real class's members (and inherited ones)."""

    API = ""

    def __init__(self, api: ApiTable) -> None:
        object.__setattr__(self, "_api", api)

    def _check(self, name: str) -> None:
        api = object.__getattribute__(self, "_api")
        if name not in api.members(self.API):
            raise AttributeError(f"tensorrt {api.version}: '{self.API}' object has no attribute '{name}'")

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_") or name == "API":
            return object.__getattribute__(self, name)
        object.__getattribute__(self, "_check")(name)
        try:
            return object.__getattribute__(self, name)
        except AttributeError:
            if getattr(getattr(type(self), name, None), "fget", False) is None:  # def_property(name, nullptr, setter)
                raise AttributeError(f"unreadable attribute '{name}'") from None
            raise NotImplementedError(f"the fake {self.API} does not model {name!r}, which the real one has") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_"):
            self._check(name)
        object.__setattr__(self, name, value)


def _enum(api: ApiTable, name: str) -> type[enum.IntEnum]:
    """An IntEnum with the real members and, where the header gave them, the real values."""
    members = api.enums[name]["members"]
    values = {k: (v if v is not None else 1000 + i) for i, (k, v) in enumerate(members.items())}
    return enum.IntEnum(name.rpartition(".")[2], values)  # type: ignore[return-value]


class _Unmodelled:
    """A real top-level name this fake does not model: present (hasattr is True), unusable."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"the fake tensorrt does not model {self._name}")

    def __getattr__(self, item: str) -> Any:
        raise NotImplementedError(f"the fake tensorrt does not model {self._name}.{item}")


class FakeTensorRT(types.ModuleType):
    """A `tensorrt` module of one version; names outside its table raise AttributeError."""

    def __init__(self, api: ApiTable) -> None:
        super().__init__("tensorrt")
        self._api = api
        self.__version__ = api.version

    def _install(self, name: str, value: Any) -> None:
        if self._api.has(name):
            setattr(self, name, value)


def fake_tensorrt(version: str = "10.3.0", *, parse_errors: tuple[tuple[str, str, str], ...] = (),
                  build_errors: tuple[str, ...] = (), input_shape: tuple[int, ...] = (-1, 3, -1, -1),
                  cuda: FakeCudaMemory | None = None, plugin_library: bool = True,
                  plugin_build_errors: tuple[str, ...] = ()) -> FakeTensorRT:
    """A `tensorrt` module with the API of `version`; `trt._record` collects what the code under test did.

    Plugins: an ONNX file holding a plugin node (EfficientNMS_TRT) parses only after `init_libnvinfer_plugins`
    registered TensorRT's bundled plugins, and only where `plugin_library` is True (False: an install without
    libnvinfer_plugin, or a release without that plugin); otherwise the parser refuses the node as the real one
    does. `plugin_build_errors`: what the builder logs, failing, for a network that holds a plugin layer. A plan
    built from such a network deserializes only after the plugins were registered in this module (as the real
    runtime, which looks the plugin's creator up in the registry) and has the plugin's four outputs. The plugin
    registry holds EfficientNMS_TRT's creator once registered; before 8.6 it has no `class_agnostic` field."""
    api = load_api(version)
    trt = FakeTensorRT(api)
    trt._record = record = {"network_flags": None, "set_flags": [], "cleared_flags": [], "pool": {}, "profiles": [],
                            "opt_level": None, "timing_cache_in": None, "monitor_calls": [], "parsed": [],
                            "plugins_registered": False}
    for name in sorted(api.module_names() - {"__version__"}):
        setattr(trt, name, _Unmodelled(name))
    for name in (n for n in api.enums if "." not in n):
        setattr(trt, name, _enum(api, name))
    for alias, member in _DTYPE_ALIASES.items():  # `trt.float32 is trt.DataType.FLOAT` in the real package
        if api.has(alias) and api.has(f"DataType.{member}"):
            setattr(trt, alias, trt.DataType[member])
    _install_loggers(trt, api)
    ctx = _Ctx(api, record, trt, parse_errors, build_errors, input_shape, cuda)
    ctx.plugin_library, ctx.plugin_build_errors = plugin_library, plugin_build_errors

    def init_libnvinfer_plugins(logger: Any, namespace: str) -> bool:
        record["plugins_registered"] = plugin_library
        return plugin_library

    trt._install("init_libnvinfer_plugins", init_libnvinfer_plugins)
    trt._install("get_plugin_registry", lambda: _Registry(ctx))
    trt._install("Builder", lambda logger: _Builder(ctx, logger))
    trt._install("OnnxParser", lambda network, logger: _Parser(ctx, network))
    trt._install("Runtime", lambda logger: _Runtime(ctx))
    trt._install("nptype", _nptype(trt))
    return trt


_DTYPE_ALIASES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "int8": "INT8", "int32": "INT32",
                  "int64": "INT64", "bool": "BOOL", "uint8": "UINT8", "fp8": "FP8", "int4": "INT4", "fp4": "FP4"}


def _nptype(trt: FakeTensorRT) -> Callable[[Any], Any]:
    mapping = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "INT32": np.int32, "INT64": np.int64,
               "BOOL": np.bool_, "UINT8": np.uint8}

    def nptype(trt_type: Any) -> Any:
        if getattr(trt_type, "name", None) in mapping and type(trt_type) is trt.DataType:
            return mapping[trt_type.name]
        raise TypeError("Could not resolve TensorRT datatype to an equivalent numpy datatype.")

    return nptype


def _install_loggers(trt: FakeTensorRT, api: ApiTable) -> None:
    """ILogger (with its nested Severity), Logger (with the Severity members the package copies onto it),
    IProgressMonitor: real Python classes, because the code under test subclasses them."""
    severity = _enum(api, "ILogger.Severity")

    class ILogger:
        Severity = severity

        def __init__(self) -> None:
            pass

    class Logger(ILogger):
        def __init__(self, min_severity: Any = severity.WARNING) -> None:
            super().__init__()
            self.min_severity = min_severity

        def log(self, severity: Any, msg: str) -> None:
            pass

    for member in severity:
        if api.has(f"Logger.{member.name}"):
            setattr(Logger, member.name, member)
    trt._install("ILogger", ILogger)
    trt._install("Logger", Logger)

    class IProgressMonitor:
        def __init__(self) -> None:
            pass

    trt._install("IProgressMonitor", IProgressMonitor)


class _Ctx:
    """What one fake module's objects share: the table, the record and the injected behaviour."""

    def __init__(self, api: ApiTable, record: dict, trt: FakeTensorRT, parse_errors: tuple, build_errors: tuple,
                 input_shape: tuple[int, ...], cuda: FakeCudaMemory | None) -> None:
        self.api, self.record, self.trt = api, record, trt
        self.parse_errors, self.build_errors, self.input_shape, self.cuda = parse_errors, build_errors, input_shape, cuda


class _Tensor(_Guarded):
    API = "ITensor"

    def __init__(self, ctx: _Ctx, name: str, shape: tuple[int, ...]) -> None:
        super().__init__(ctx.api)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", shape)


class _Network(_Guarded):
    API = "INetworkDefinition"

    def __init__(self, ctx: _Ctx, flags: int) -> None:
        super().__init__(ctx.api)
        self._ctx, self._inputs, self._plugin = ctx, [], False

    @property
    def num_inputs(self) -> int:
        return len(self._inputs)

    def get_input(self, i: int) -> _Tensor:
        return self._inputs[i]


class _Profile(_Guarded):
    API = "IOptimizationProfile"

    def __init__(self, ctx: _Ctx) -> None:
        super().__init__(ctx.api)
        self._shapes: dict[str, tuple] = {}

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:  # noqa: A002  (the real keywords)
        self._shapes[input] = (tuple(min), tuple(opt), tuple(max))


class _TimingCache(_Guarded):
    API = "ITimingCache"

    def __init__(self, ctx: _Ctx, data: bytes) -> None:
        super().__init__(ctx.api)
        self._data = data

    def serialize(self) -> bytes:
        return self._data + b"+timed"

    def combine(self, input_cache: "_TimingCache", ignore_mismatch: bool) -> bool:
        return True


class _Config(_Guarded):
    API = "IBuilderConfig"

    def __init__(self, ctx: _Ctx) -> None:
        super().__init__(ctx.api)
        self._ctx, self._cache = ctx, None
        object.__setattr__(self, "_opt_level", 3)  # TensorRT's default level
        object.__setattr__(self, "_monitor", None)

    builder_optimization_level = property(lambda self: self._opt_level,
                                          lambda self, v: object.__setattr__(self, "_opt_level", v))
    progress_monitor = property(lambda self: self._monitor, lambda self, v: object.__setattr__(self, "_monitor", v))

    def set_memory_pool_limit(self, pool: Any, pool_size: int) -> None:
        self._ctx.record["pool"][pool.name] = pool_size

    def set_flag(self, flag: Any) -> None:
        self._ctx.record["set_flags"].append(flag.name)

    def clear_flag(self, flag: Any) -> None:
        self._ctx.record["cleared_flags"].append(flag.name)

    def add_optimization_profile(self, profile: _Profile) -> int:
        self._ctx.record["profiles"].append(profile._shapes)
        profiles = self.__dict__.setdefault("_profiles", [])
        profiles.append(dict(profile._shapes))
        return len(profiles) - 1

    def create_timing_cache(self, serialized_timing_cache: bytes) -> _TimingCache | None:
        data = bytes(serialized_timing_cache)
        return None if data == b"garbage" else _TimingCache(self._ctx, data)

    def set_timing_cache(self, cache: _TimingCache, ignore_mismatch: bool) -> bool:
        self._ctx.record["timing_cache_in"] = cache._data
        self._cache = cache
        return cache._data != b"other-gpu"

    def get_timing_cache(self) -> _TimingCache | None:
        return self._cache


class _Builder(_Guarded):
    API = "Builder"

    def __init__(self, ctx: _Ctx, logger: Any) -> None:
        super().__init__(ctx.api)
        self._ctx, self._logger = ctx, logger

    def create_network(self, flags: int = 0) -> _Network:
        self._ctx.record["network_flags"] = flags
        return _Network(self._ctx, flags)

    def create_builder_config(self) -> _Config:
        return _Config(self._ctx)

    def create_optimization_profile(self) -> _Profile:
        return _Profile(self._ctx)

    def build_serialized_network(self, network: _Network, config: _Config) -> bytes | None:
        record = self._ctx.record
        record["opt_level"] = config._opt_level
        monitor = config._monitor
        if monitor is not None:
            monitor.phase_start("Building engine", None, 3)
            for step in range(3):
                record["monitor_calls"].append(monitor.step_complete("Building engine", step))
            monitor.phase_finish("Building engine")
        errors = self._ctx.build_errors + (self._ctx.plugin_build_errors if network._plugin else ())
        errors += self._dla_shape_errors(config)
        for msg in errors:
            self._logger.log(self._ctx.trt.ILogger.Severity.ERROR, msg)
        if errors:
            return None
        return b"PLAN" + (NMS_PLAN_MARK if network._plugin else b"") + repr(record["set_flags"]).encode("ascii")


    def _dla_shape_errors(self, config: _Config) -> tuple[str, ...]:
        """TensorRT refuses dynamic shapes on DLA: NVIDIA's DLA restrictions ("Dynamic dimensions are not
        supported"; a profile's min, opt and max must be equal; runtime dimensions must equal the build's)."""
        device = self._ctx.record.get("default_device_type")
        if getattr(device, "name", None) != "DLA":
            return ()
        return tuple(f"{name}: DLA does not support dynamic shapes: the optimization profile's min {list(mn)}, opt "
                     f"{list(opt)} and max {list(mx)} must be equal"
                     for shapes in config.__dict__.get("_profiles", []) for name, (mn, opt, mx) in shapes.items()
                     if not mn == opt == mx)


class _Err(_Guarded):
    """ParserError: `node_name()`/`node_operator()` exist only where the real table has them (10.x+)."""

    API = "ParserError"

    def __init__(self, ctx: _Ctx, index: int, name: str, op: str, desc: str) -> None:
        super().__init__(ctx.api)
        self._index, self._name, self._op, self._desc = index, name, op, desc

    def desc(self) -> str:
        return self._desc

    def node(self) -> int:
        return self._index

    def node_name(self) -> str:
        return self._name

    def node_operator(self) -> str:
        return self._op


PLUGIN_OP = b"EfficientNMS_TRT"  # the plugin node the fake parser recognises in a model file


class _Parser(_Guarded):
    API = "OnnxParser"

    def __init__(self, ctx: _Ctx, network: _Network) -> None:
        super().__init__(ctx.api)
        self._ctx, self._network = ctx, network
        self._errors = [_Err(ctx, i, *e) for i, e in enumerate(ctx.parse_errors)]

    def parse_from_file(self, model: str) -> bool:
        self._ctx.record["parsed"].append(model)
        self._network._inputs.append(_Tensor(self._ctx, "x", self._ctx.input_shape))
        path = Path(model)
        if path.is_file() and PLUGIN_OP in path.read_bytes():
            if self._ctx.record["plugins_registered"]:
                self._network._plugin = True
            else:  # onnx-tensorrt's fallback importer finds no creator in the plugin registry
                self._errors.append(_Err(self._ctx, len(self._errors), "edge_nms/EfficientNMS_TRT", "EfficientNMS_TRT",
                                         'Assertion failed: creator && "Plugin not found, are the plugin name, '
                                         'version, and namespace correct?"'))
        return not self._errors

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, index: int) -> _Err:
        return self._errors[index]


# --- TensorRT runtime: a plan whose engine computes y = 2x + 1 ---------------------------------


class _Runtime(_Guarded):
    API = "Runtime"

    def __init__(self, ctx: _Ctx) -> None:
        super().__init__(ctx.api)
        self._ctx = ctx

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> "_Engine | None":
        plan = bytes(serialized_engine)
        if not plan.startswith(b"PLAN"):
            return None
        plugin = plan[4:].startswith(NMS_PLAN_MARK)
        if plugin and not self._ctx.record["plugins_registered"]:
            return None  # "getPluginCreator could not find plugin: EfficientNMS_TRT version: 1", then no engine
        return _Engine(self._ctx, plugin)


# the plugin's four outputs: name -> (shape after the batch dimension, dtype name); K = 8 boxes
NMS_OUTPUTS = {"num_detections": ((1,), "INT32"), "detection_boxes": ((8, 4), "FLOAT"),
               "detection_scores": ((8,), "FLOAT"), "detection_classes": ((8,), "INT32")}
NMS_PLAN_MARK = b"+EfficientNMS_TRT"


def _version(api: ApiTable) -> tuple[int, ...]:
    return tuple(int(p) for p in api.version.split(".")[:2])


def _runtime_error(ctx: _Ctx, msg: str) -> None:
    """What TensorRT's runtime logs as an error (kept in `trt._record["runtime_errors"]`)."""
    ctx.record.setdefault("runtime_errors", []).append(msg)


class _Engine(_Guarded):
    """The engine of a plan: y = 2x + 1 over one optimization profile (batch 1..4).

    Contexts follow each release's header (NvInferRuntime.h): a new context gets optimization profile 0 on 8.5
    only if it is the engine's first ("The first execution context created will call setOptimizationProfile(0)
    implicitly", 8.5.2), on 8.6 only if no live context holds profile 0 ("if there are no other execution
    contexts assigned to optimization profile 0", v8.6.1 1749-1752), otherwise -1; from 10 always 0 ("The newly
    created execution context will be assigned optimization profile 0", v10.3.0 2613-2614). 9.x (no table here)
    is taken as 10. Activation memory: `create_execution_context()` (STATIC) allocates the engine's
    `device_memory_size` inside TensorRT (counted in `trt._record["static_context_bytes"]`); a context made
    without memory (8.5-10.x `create_execution_context_without_device_memory`, 10+ USER_MANAGED) enqueues only
    once memory of at least that size is assigned."""

    API = "ICudaEngine"
    _activation_bytes = 64 << 10  # what one context needs for activations, over every shape of the profile

    def __init__(self, ctx: _Ctx, plugin: bool = False) -> None:
        super().__init__(ctx.api)
        self._ctx = ctx
        self._outputs = dict(NMS_OUTPUTS) if plugin else {"y": (None, "FLOAT")}  # y = 2x + 1: x's shape
        self._created = 0
        self._profile_holders: weakref.WeakSet[Any] = weakref.WeakSet()  # live contexts on profile 0

    num_io_tensors = property(lambda self: 1 + len(self._outputs))
    num_optimization_profiles = property(lambda self: 1)
    device_memory_size = property(lambda self: self._activation_bytes)
    device_memory_size_v2 = property(lambda self: self._activation_bytes)

    def get_tensor_name(self, index: int) -> str:
        return ("x", *self._outputs)[index]

    def get_tensor_mode(self, name: str) -> Any:
        mode = self._ctx.trt.TensorIOMode
        return mode.INPUT if name == "x" else mode.OUTPUT

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (-1, 3, 4, 4)

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[tuple[int, ...]]:
        return [(1, 3, 4, 4), (2, 3, 4, 4), (4, 3, 4, 4)]

    def get_tensor_dtype(self, name: str) -> Any:
        return self._ctx.trt.DataType[self._outputs[name][1] if name in self._outputs else "FLOAT"]

    def create_execution_context(self, *args: Any, **kwargs: Any) -> "_Context":
        strategies = getattr(self._ctx.trt, "ExecutionContextAllocationStrategy", None)
        if strategies is None and (args or kwargs):  # 8.x: createExecutionContext() takes no argument
            raise TypeError("create_execution_context(): incompatible function arguments")
        strategy = (list(args) + list(kwargs.values()) or [None])[0]
        user_managed = strategies is not None and strategy == strategies.USER_MANAGED
        return self._new_context(memory=not (user_managed or self.__dict__.get("_without_memory", False)))

    def create_execution_context_without_device_memory(self) -> "_Context":
        # through create_execution_context, so a subclass that overrides that one sees every context made
        self.__dict__["_without_memory"] = True
        try:
            return self.create_execution_context()
        finally:
            self.__dict__["_without_memory"] = False

    def _new_context(self, memory: bool) -> "_Context":
        """A context of this engine (its profile from `_initial_profile`); `memory`: TensorRT allocates its
        activations itself. Subclasses return their own context type here."""
        return _Context(self._ctx, self._outputs, engine=self, device_memory=memory)

    def _initial_profile(self) -> int:
        """The optimization profile TensorRT gives a context it creates now (see the class docstring)."""
        first, self._created = self._created == 0, self._created + 1
        version = _version(self._ctx.api)
        if version >= (9, 0):
            return 0
        if version < (8, 6):
            return 0 if first else -1
        return 0 if not len(self._profile_holders) else -1

    def _take_profile(self, context: "_Context", index: int) -> bool:
        """setOptimizationProfileAsync: before 9, profile 0 is refused while another live context holds it."""
        if not 0 <= index < 1:
            _runtime_error(self._ctx, f"profile index {index} is out of range [0, 1)")
            return False
        holders = [c for c in self._profile_holders if c is not context]
        if _version(self._ctx.api) < (9, 0) and holders:
            _runtime_error(self._ctx, f"Profile {index} has been chosen by another IExecutionContext. Saw profile "
                                      f"{index}, expected profile index in [1, 1)")
            return False
        self._profile_holders.add(context)
        return True


class _Context(_Guarded):
    """An execution context with shape state. Follows TensorRT's rule for CUDA graphs (developer guide,
    "CUDA Graphs"; trtexec in samples/common/sampleInference.cpp at v10.3.0 enqueues once after setting
    shapes, then captures, and never changes a captured context's shapes): after `set_input_shape` changes
    a shape, the next enqueue must be a plain one; an enqueue under capture before it fails (False), and a
    graph captured before the change replays stale (FakeCudaMemory.launch_graph). `execute_async_v3`
    reads the bound addresses when it is enqueued, as the real one does.

    A context with optimization profile -1 (see _Engine) rejects every input shape and enqueue ("all calls to
    enqueueV2()/enqueueV3()/executeV2() will fail until a valid profile index has been set", v8.6.1 2793-2797);
    one made without device memory refuses to enqueue until `device_memory` / `set_device_memory` gave it a
    block of at least the engine's size. `_enqueue_blocker` says why an enqueue fails (override it to add a
    reason). Made directly (no `engine`), a context has profile 0 and its own memory."""

    API = "IExecutionContext"

    def __init__(self, ctx: _Ctx, outputs: dict[str, tuple[Any, str]] | None = None, engine: _Engine | None = None,
                 device_memory: bool = True) -> None:
        super().__init__(ctx.api)
        self._fake = ctx
        self._cuda = ctx.cuda
        self._outputs = outputs or {"y": (None, "FLOAT")}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}
        self._generation = 0  # bumped by every shape change
        self._needs_enqueue = False  # a shape changed and no plain enqueue followed yet
        self._engine = engine
        self._profile = engine._initial_profile() if engine is not None else 0
        if engine is not None and self._profile == 0:
            engine._profile_holders.add(self)
        needed = engine._activation_bytes if engine is not None else 0
        self._memory: int | None = None if not device_memory else 0  # 0: TensorRT's own allocation
        if device_memory and needed:
            ctx.record.setdefault("static_context_bytes", []).append(needed)

    active_optimization_profile = property(lambda self: self._profile)

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        taken = self._engine._take_profile(self, profile_index) if self._engine is not None else profile_index == 0
        if taken:
            self._profile = profile_index
        return taken

    def _set_memory(self, memory: int) -> None:
        self._memory = int(memory)

    device_memory = property(None, _set_memory)  # write-only, as the binding's (def_property(..., nullptr, set))

    def set_device_memory(self, memory: int, size: int) -> None:
        needed = self._engine._activation_bytes if self._engine is not None else 0
        if size < needed:
            _runtime_error(self._fake, f"setDeviceMemoryV2: size {size} is smaller than the {needed} bytes needed")
            return
        self._memory = int(memory)

    def _enqueue_blocker(self) -> str | None:
        """Why TensorRT would refuse to enqueue this context now, or None."""
        if self._profile < 0:
            return "no optimization profile set (active_optimization_profile is -1)"
        if self._memory is None:
            return "no device memory: the context was created without it and none was assigned"
        return None

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        if self._profile < 0:
            _runtime_error(self._fake, f"setInputShape: {name}: the context has no optimization profile")
            return False
        if len(shape) != 4 or tuple(shape[1:]) != (3, 4, 4):
            return False
        if self._shapes.get(name) != tuple(shape):
            self._generation += 1
            self._needs_enqueue = True
        self._shapes[name] = tuple(shape)
        for out, (tail, _) in self._outputs.items():
            self._shapes[out] = tuple(shape) if tail is None else (shape[0], *tail)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def set_tensor_address(self, name: str, memory: int) -> bool:
        self._addresses[name] = memory
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        assert self._cuda is not None
        blocker = self._enqueue_blocker()
        if blocker is not None:
            _runtime_error(self._fake, f"enqueueV3: {blocker}")
            return False
        if self._cuda.capturing and self._needs_enqueue:
            return False  # capture right after a shape change: TensorRT's deferred shape work cannot be captured
        self._needs_enqueue = False
        if "y" not in self._outputs:  # the plugin's engine: no detections (the zeroed outputs say 0 of them)
            return True
        count = int(np.prod(self._shapes["x"]))
        src, dst = self._addresses["x"], self._addresses["y"]

        def compute() -> None:
            x = np.ctypeslib.as_array((ctypes.c_float * count).from_address(src))
            y = np.ctypeslib.as_array((ctypes.c_float * count).from_address(dst))
            y[:] = 2 * x + 1

        self._cuda.enqueue(compute, self)
        return True


class _Field(_Guarded):
    API = "PluginField"

    def __init__(self, ctx: _Ctx, name: str) -> None:
        super().__init__(ctx.api)
        object.__setattr__(self, "name", name)


class _Creator(_Guarded):
    """EfficientNMS_TRT's creator: the fields of plugin/efficientNMSPlugin (class_agnostic from 8.6)."""

    API = "IPluginCreator"

    def __init__(self, ctx: _Ctx) -> None:
        super().__init__(ctx.api)
        names = ["score_threshold", "iou_threshold", "max_output_boxes", "background_class", "score_activation",
                 "class_agnostic", "box_coding"]
        if tuple(int(p) for p in ctx.api.version.split(".")[:2]) < (8, 6):
            names.remove("class_agnostic")
        object.__setattr__(self, "field_names", [_Field(ctx, n) for n in names])


class _Registry(_Guarded):
    API = "IPluginRegistry"

    def __init__(self, ctx: _Ctx) -> None:
        super().__init__(ctx.api)
        self._ctx = ctx

    def _find(self, name: str, version: str) -> "_Creator | None":
        found = self._ctx.record["plugins_registered"] and (name, version) == ("EfficientNMS_TRT", "1")
        return _Creator(self._ctx) if found else None

    def get_plugin_creator(self, type: str, version: str, plugin_namespace: str = "") -> "_Creator | None":  # noqa: A002
        return self._find(type, version)

    def get_creator(self, name: str, version: str, plugin_namespace: str = "") -> "_Creator | None":
        return self._find(name, version)


def import_tensorrt_backend(monkeypatch: Any, trt: Any, cuda: "FakeCudaMemory") -> types.ModuleType:
    """Import engines.backends.tensorrt_backend against fake `trt` and `cuda` (stands in for a Jetson's TensorRT).

    The registry and module cache are patched through `monkeypatch`, so they are restored after the test; the
    caller pops the module from sys.modules at teardown (`forget_tensorrt_backend`).
    """
    import importlib
    import sys

    from engines import cuda as cuda_mem
    from engines.backends import BACKENDS

    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(cuda_mem, "missing_bindings", lambda: None)
    monkeypatch.delitem(sys.modules, "engines.backends.tensorrt_backend", raising=False)
    monkeypatch.setattr(BACKENDS, "_plugins", {k: v for k, v in BACKENDS._plugins.items() if k != "tensorrt"})
    monkeypatch.setattr(BACKENDS, "_disabled", dict(BACKENDS._disabled))
    module = importlib.import_module("engines.backends.tensorrt_backend")
    monkeypatch.setattr(module, "open_cuda_memory", lambda: cuda)
    return module


def forget_tensorrt_backend() -> None:
    """Drop the module imported against fakes, so the next import sees the real environment again."""
    import sys

    sys.modules.pop("engines.backends.tensorrt_backend", None)
