"""The runtime side of tests/fake_nvidia.py's TensorRT: a plan whose engine computes y = 2x + 1 (or the NMS
plugin's four outputs), execution contexts with the optimization-profile and device-memory rules of each release,
and the plugin registry."""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import numpy as np

from tests.fake_nvidia_api import ApiTable, _Ctx, _Guarded
from tests.fake_nvidia_builder import NMS_PLAN_MARK


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

    def get_plugin_creator(self, type: str, version: str,  # the real keywords
                           plugin_namespace: str = "") -> "_Creator | None":
        return self._find(type, version)

    def get_creator(self, name: str, version: str, plugin_namespace: str = "") -> "_Creator | None":
        return self._find(name, version)
