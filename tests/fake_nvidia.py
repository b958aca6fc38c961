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

The parts live in modules of their own: tests/fake_nvidia_cuda.py (`FakeCudaMemory`), fake_nvidia_api.py (the
tables and the guard), fake_nvidia_builder.py (network, config, builder, parser) and fake_nvidia_runtime.py (runtime,
engine, contexts, plugin registry). This module assembles the fake `tensorrt` and is what tests import: every name
the parts define is importable from here.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import numpy as np

from tests.fake_nvidia_api import (API_DIR, ApiTable, FakeTensorRT, _Ctx, _enum, _Guarded, _Unmodelled, api_versions,
                                   load_api)
from tests.fake_nvidia_builder import (NMS_PLAN_MARK, PLUGIN_OP, _Builder, _Config, _Err, _Network, _Parser, _Profile,
                                       _Tensor, _TimingCache)
from tests.fake_nvidia_cuda import FakeCudaMemory
from tests.fake_nvidia_runtime import (NMS_OUTPUTS, _Context, _Creator, _Engine, _Field, _Registry, _Runtime,
                                       _runtime_error, _version)

__all__ = [  # every name this module defined before it was split, private ones included: tests subclass them
    "API_DIR", "ApiTable", "FakeCudaMemory", "FakeTensorRT", "NMS_OUTPUTS", "NMS_PLAN_MARK", "PLUGIN_OP", "_Builder",
    "_Config", "_Context", "_Creator", "_Ctx", "_Engine", "_Err", "_Field", "_Guarded", "_Network", "_Parser",
    "_Profile", "_Registry", "_Runtime", "_Tensor", "_TimingCache", "_Unmodelled", "_enum", "_runtime_error",
    "_version", "api_versions", "fake_tensorrt", "forget_tensorrt_backend", "import_tensorrt_backend", "load_api",
]


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


# The parts' classes are presented as this module's (numpy's `set_module` idiom): tests import them from here, and
# tests/test_tensorrt_api_tables.py tells the fake's own classes from its users' subclasses by their module.
for _name in __all__:
    _part = globals()[_name]
    if isinstance(_part, type) and _part.__module__.startswith(f"{__name__}_"):
        _part.__module__ = __name__
