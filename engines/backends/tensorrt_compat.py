"""What differs between TensorRT releases at run time, kept out of the backend and the builder.

- dtypes: `trt.nptype` is not used. On TensorRT 8.5 it names `np.bool`, which numpy 1.24 removed
  (NVIDIA/TensorRT#2557), and on every release it raises TypeError for BF16/FP8/INT4/FP4, which
  numpy cannot hold. The agent maps I/O dtypes itself and refuses the rest with a clear error.
- logging: TensorRT keeps ONE logger pointer per process, the first one a Runtime/Builder got; later
  loggers are ignored. So every Runtime and Builder here gets the same capturing logger
  (`shared_logger`), and a build reads the errors logged since it started.
- CUDA graphs: capturing `execute_async_v3` fails on TensorRT 8.5.2, so capture starts at 8.6.
- plugins: TensorRT's bundled plugins (EfficientNMS_TRT) are in the plugin registry only after
  `init_libnvinfer_plugins`; a plan holding one deserializes only then, so the backend and the build both
  call `register_plugins` (once per process) before they deserialize or parse.
- DLA: a plan built for `dla:N` runs on the core the Runtime names (`Runtime.DLA_core`, default 0), so
  the core from the engine's sidecar is set before `deserialize_cuda_engine` (`select_dla_core`).
- contexts without their own activation memory (`context_without_memory`, `assign_device_memory`,
  `activation_size`): `create_execution_context_without_device_memory` + the write-only `device_memory`
  property on 8.5/8.6; `create_execution_context(ExecutionContextAllocationStrategy.USER_MANAGED)` +
  `set_device_memory(ptr, size)` from 10 (the former is deprecated in 10.0 and gone in 11); the size is
  `device_memory_size_v2` from 10.1 (`device_memory_size` before, gone in 11).
- optimization profiles of new contexts (`context_profile`): on 8.5 only the first context gets profile 0
  implicitly, on 8.6 a new context gets it only if no other context holds it, otherwise its profile is -1 and
  every enqueue fails (NvInferRuntime.h at 8.5.2 lines 1589-1591 and 2506-2508, at v8.6.1 1749-1752 and
  2793-2797); from 10 "the newly created execution context will be assigned optimization profile 0" (v10.3.0
  2613-2614 and 3888-3889). A second context asking for profile 0 on 8.x fails ("Profile 0 has been chosen by
  another IExecutionContext", NVIDIA/TensorRT#846).
Importable without TensorRT: `trt` is passed in.
"""

from __future__ import annotations

import itertools
import re
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from engines.model.sidecar import read_sidecar
from kernel.errors import ModelError

# TensorRT DataType member name -> numpy dtype (names as in every binding since 8.5).
NUMPY_DTYPES: dict[str, Any] = {
    "FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "INT32": np.int32, "INT64": np.int64,
    "BOOL": np.bool_, "UINT8": np.uint8, "DOUBLE": np.float64,
}
_ERRORS_KEPT = 200
_SHARED: dict[int, Any] = {}
_SHARED_LOCK = threading.Lock()
_PLUGINS: dict[int, tuple[Any, str]] = {}  # id(trt) -> (trt, what registering did); trt kept so its id is not reused


def dtype_name(dtype: Any) -> str:
    """"FLOAT" for `trt.DataType.FLOAT` (pybind11 enums have `.name`; str() gives "DataType.FLOAT")."""
    name = getattr(dtype, "name", None) or str(dtype)
    return str(name).rsplit(".", 1)[-1].upper()


def numpy_dtype(dtype: Any, tensor: str) -> np.dtype:
    """The numpy dtype of an I/O tensor; BF16/FP8/INT4/FP4 I/O is a ModelError naming the tensor."""
    name = dtype_name(dtype)
    if name in NUMPY_DTYPES:
        return np.dtype(NUMPY_DTYPES[name])
    raise ModelError(f"I/O tensor {tensor!r} is {name}, which numpy cannot hold, so the agent cannot feed or read "
                     "it; export the model with float32/float16 inputs and outputs (cast inside the graph)",
                     code="MODEL_DTYPE_UNSUPPORTED")


def version_tuple(version: str) -> tuple[int, ...]:
    """"8.5.2.2" -> (8, 5, 2, 2); non-numeric tails ("10.0-fake") are ignored."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("-", 1)[0])[:4])


def graph_capture_blocker(trt: Any) -> str | None:
    """Why CUDA-graph capture is not attempted with this TensorRT, or None."""
    if version_tuple(str(getattr(trt, "__version__", "0"))) < (8, 6):
        return (f"skipped: capturing execute_async_v3 into a CUDA graph fails on TensorRT {trt.__version__} "
                "(works from 8.6); plain enqueue is used")
    return None


def activation_size(engine: Any) -> int:
    """Bytes of activation memory one context of `engine` needs, at most, over all profiles and shapes."""
    if hasattr(engine, "device_memory_size_v2"):  # getDeviceMemorySizeV2, 10.1+ (the only one in 11)
        return int(engine.device_memory_size_v2)
    return int(engine.device_memory_size)  # getDeviceMemorySize, 8.5 to 10.x


def context_without_memory(trt: Any, engine: Any) -> Any:
    """An execution context whose activation memory the caller supplies (`assign_device_memory`); None where
    TensorRT could not create one."""
    strategies = getattr(trt, "ExecutionContextAllocationStrategy", None)  # 10.0+
    if strategies is not None and hasattr(strategies, "USER_MANAGED"):
        return engine.create_execution_context(strategies.USER_MANAGED)
    return engine.create_execution_context_without_device_memory()  # 8.5, 8.6


def assign_device_memory(context: Any, ptr: int, size: int) -> None:
    """Give `context` the activation block at `ptr` (`size` bytes, at least `activation_size(engine)`)."""
    if hasattr(context, "set_device_memory"):  # setDeviceMemoryV2 (10.1+): TensorRT checks the size
        context.set_device_memory(ptr, size)
    else:  # a write-only property on 8.5/8.6 (no getter: `hasattr(context, "device_memory")` is False there)
        context.device_memory = ptr


def context_profile(context: Any) -> int:
    """The context's optimization profile; -1 where TensorRT gave it none (8.5/8.6: see the module docstring)."""
    return int(context.active_optimization_profile)


def sidecar_dla_core(plan: Path) -> int | None:
    """The DLA core a cached plan was built for (its sidecar `<plan>.json`), None for a GPU plan.

    The spec in the cache key (`parts.spec.dla_core`) is what the engine is; the build report's
    `dla.core` is read when the key parts are absent. No sidecar (a plan from elsewhere): the GPU. A
    sidecar that cannot be read is ENGINE_INCOMPATIBLE: guessing core 0 could run a dla:1 plan on the
    wrong core, and the cache quarantines and rebuilds an engine with that code."""
    data = read_sidecar(plan, "its DLA core")
    if data is None:
        return None
    spec = (data.get("parts") or {}).get("spec")
    core = spec.get("dla_core") if isinstance(spec, dict) else None
    if core is None:
        core = ((data.get("report") or {}).get("dla") or {}).get("core")
    if core is not None and (isinstance(core, bool) or not isinstance(core, int) or core < 0):
        raise ModelError(f"{plan.name}.json: DLA core {core!r} is not a core number", code="ENGINE_INCOMPATIBLE")
    return core


def select_dla_core(trt: Any, runtime: Any, core: int, label: str) -> None:
    """Point `runtime` at DLA core `core` before a plan is deserialized; ENGINE_DLA_UNAVAILABLE where this
    TensorRT has no runtime DLA API or reports fewer cores (0 off Orin/Xavier and on releases without DLA)."""
    version = getattr(trt, "__version__", "?")
    if not (hasattr(runtime, "DLA_core") and hasattr(runtime, "num_DLA_cores")):
        raise ModelError(f"{label}: built for dla:{core}, but TensorRT {version} has no Runtime.DLA_core; "
                         "build the model for the GPU", code="ENGINE_DLA_UNAVAILABLE")
    cores = int(runtime.num_DLA_cores)
    if core >= cores:
        seen = "no DLA cores" if cores == 0 else f"DLA cores 0..{cores - 1}"
        raise ModelError(f"{label}: built for dla:{core}, but TensorRT {version} here reports {seen} "
                         "(Runtime.num_DLA_cores); build it for this device (gpu or an existing core)",
                         code="ENGINE_DLA_UNAVAILABLE")
    runtime.DLA_core = core


def shared_logger(trt: Any) -> Any:
    """The one logger every Runtime and Builder of this `trt` module gets (TensorRT keeps only the first)."""
    with _SHARED_LOCK:
        logger = _SHARED.get(id(trt))
        if logger is None:
            logger = _SHARED[id(trt)] = _make_logger(trt)
        return logger


def _make_logger(trt: Any) -> Any:
    class CapturingLogger(trt.ILogger):
        """Warnings to stderr; errors kept (numbered) so a build can report the ones it caused."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self._count = itertools.count(1)
            self._errors: deque[tuple[int, str]] = deque(maxlen=_ERRORS_KEPT)
            self._lock = threading.Lock()

        @property
        def errors(self) -> list[str]:
            """Every error still kept, oldest first."""
            with self._lock:
                return [msg for _, msg in self._errors]

        def mark(self) -> int:
            """A point in the error stream; `errors_since(mark)` returns what came after it."""
            with self._lock:
                return self._errors[-1][0] if self._errors else 0

        def errors_since(self, mark: int) -> list[str]:
            """Errors logged after `mark` (by any thread: TensorRT's logger is process-wide)."""
            with self._lock:
                return [msg for n, msg in self._errors if n > mark]

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            if level <= int(trt.ILogger.Severity.ERROR):
                with self._lock:
                    self._errors.append((next(self._count), msg))
            if level <= int(trt.ILogger.Severity.WARNING):
                print(f"[TRT {getattr(severity, 'name', level)}] {msg}", file=sys.stderr)

    return CapturingLogger()


def register_plugins(trt: Any) -> str:
    """Register TensorRT's bundled plugins (EfficientNMS_TRT among them) once per process, with the shared logger;
    what happened, for error messages. The ONNX parser finds a plugin node's creator, and the runtime a plugin
    layer's, only in that registry."""
    with _SHARED_LOCK:
        done = _PLUGINS.get(id(trt))
    if done is not None:
        return done[1]
    result = _init_plugins(trt)
    with _SHARED_LOCK:
        _PLUGINS.setdefault(id(trt), (trt, result))
        return _PLUGINS[id(trt)][1]


def _init_plugins(trt: Any) -> str:
    init = getattr(trt, "init_libnvinfer_plugins", None)
    if init is None:
        return "this TensorRT has no init_libnvinfer_plugins"
    try:
        ok = init(shared_logger(trt), "")
    except Exception as exc:  # noqa: BLE001  (a broken plugin library must leave plugin-free engines usable)
        return f"init_libnvinfer_plugins failed: {type(exc).__name__}: {exc}"
    return "plugins registered" if ok is not False else "init_libnvinfer_plugins returned False"


def plugin_fields(trt: Any, name: str, version: str) -> list[str] | None:
    """The field names a registered plugin creator accepts; None where it is not registered or cannot be read.

    `get_plugin_creator` (8.5 to 10.x) returns an IPluginCreator with `field_names`; 11 has only `get_creator`."""
    try:
        registry = trt.get_plugin_registry()
        lookup = getattr(registry, "get_plugin_creator", None) or registry.get_creator
        creator = lookup(name, version, "")
        fields = None if creator is None else creator.field_names
        if fields is None:
            return None
        return [f.name.decode() if isinstance(f.name, bytes) else str(f.name) for f in fields]
    except (AttributeError, RuntimeError, TypeError):  # an interface without field_names: cannot tell
        return None
