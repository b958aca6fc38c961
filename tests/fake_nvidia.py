"""Recording stand-ins for the TensorRT Python API and for a CUDA memory implementation.

They let the TensorRT build logic and the TrtEngine runtime run on machines without a GPU, so their
control flow (feature detection across TensorRT 8.6 / 10 / 11, I/O binding, CUDA-graph capture and
fallback, error mapping) is tested everywhere. They model the API's *shape*, not its numerics: the
real libraries are exercised by the contract suites wherever they import.
"""

from __future__ import annotations

import ctypes
import enum
import time
import types
from typing import Any, Callable

import numpy as np

from engines.cuda_mem import CudaError, DeviceBuffer

GENERATIONS = {
    # generation: (network creation flags, builder flags, has IProgressMonitor, parser errors carry node names)
    "8.6": (("EXPLICIT_BATCH",), ("FP16", "INT8", "TF32"), True, True),
    "10": (("EXPLICIT_BATCH", "STRONGLY_TYPED"), ("FP16", "INT8", "TF32"), True, True),
    "11": (("STRONGLY_TYPED",), ("TF32",), True, True),
}


class FakeCudaMemory:
    """Host memory posing as device memory; stream work runs at once, or is recorded while capturing."""

    name = "fake"

    def __init__(self, supports_graphs: bool = True, corrupt_replay: bool = False) -> None:
        self.supports_graphs = supports_graphs
        self.corrupt_replay = corrupt_replay
        self._buffers: dict[int, Any] = {}
        self._capture: list[Callable[[], None]] | None = None
        self.launches = 0
        self.closed = False

    def enqueue(self, op: Callable[[], None]) -> None:
        """Run now, or record into the graph being captured."""
        if self._capture is not None:
            self._capture.append(op)
        else:
            op()

    def malloc(self, nbytes: int) -> DeviceBuffer:
        if nbytes > 1 << 40:
            raise CudaError("cudaMalloc failed: cudaErrorMemoryAllocation")
        buf = ctypes.create_string_buffer(max(1, nbytes))
        self._buffers[ctypes.addressof(buf)] = buf
        return DeviceBuffer(ctypes.addressof(buf), nbytes, buf)

    def free(self, buffer: DeviceBuffer) -> None:
        del self._buffers[buffer.ptr]

    def pinned_empty(self, shape: Any, dtype: Any) -> np.ndarray:
        return np.zeros(tuple(shape), np.dtype(dtype))

    def free_pinned(self, array: np.ndarray) -> None:
        pass

    def create_stream(self) -> Any:
        return object()

    def destroy_stream(self, stream: Any) -> None:
        pass

    def stream_handle(self, stream: Any) -> int:
        return id(stream)

    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Any) -> None:
        self.enqueue(lambda: ctypes.memmove(dst.ptr, src.ctypes.data, src.nbytes))

    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Any) -> None:
        self.enqueue(lambda: ctypes.memmove(dst.ctypes.data, src.ptr, dst.nbytes))

    def synchronize(self, stream: Any) -> None:
        pass

    def create_event(self) -> Any:
        return [0.0]

    def record_event(self, event: Any, stream: Any) -> None:
        event[0] = time.perf_counter()

    def synchronize_event(self, event: Any) -> None:
        pass

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end[0] - start[0]) * 1e3

    def destroy_event(self, event: Any) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        return 6 << 30, 8 << 30

    def begin_capture(self, stream: Any) -> None:
        self._capture = []

    def end_capture(self, stream: Any) -> Any:
        ops, self._capture = self._capture or [], None
        return ("graph", ops)

    def launch_graph(self, graph: Any, stream: Any) -> None:
        self.launches += 1
        for op in graph[1]:
            op()
        if self.corrupt_replay:
            for buf in self._buffers.values():
                ctypes.memset(buf, 0x7F, 4)

    def destroy_graph(self, graph: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True


# --- TensorRT ---------------------------------------------------------------------------------


class Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


def fake_tensorrt(generation: str = "10", *, parse_errors: tuple[tuple[str, str, str], ...] = (),
                  build_errors: tuple[str, ...] = (), input_shape: tuple[int, ...] = (-1, 3, -1, -1),
                  cuda: FakeCudaMemory | None = None, node_names: bool | None = None) -> types.ModuleType:
    """A `tensorrt` module of one API generation; `trt.record` collects what the code under test did."""
    net_flags, builder_flags, has_monitor, named = GENERATIONS[generation]
    node_names = named if node_names is None else node_names
    trt = types.ModuleType("tensorrt")
    trt.__version__ = f"{generation}.0-fake"
    trt.record = record = {"network_flags": None, "set_flags": [], "cleared_flags": [], "pool": {}, "profiles": [],
                           "opt_level": None, "timing_cache_in": None, "monitor_calls": []}
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(**{n: i for i, n in enumerate(net_flags)})
    trt.BuilderFlag = types.SimpleNamespace(**{n: n for n in builder_flags})
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    trt.DataType = types.SimpleNamespace(FLOAT="FLOAT")
    trt.nptype = lambda dtype: np.float32

    class ILogger:
        Severity = globals()["Severity"]

        def __init__(self) -> None:
            pass

    class Logger(ILogger):
        WARNING = Severity.WARNING

        def __init__(self, level: Any = None) -> None:
            super().__init__()

        def log(self, severity: Any, msg: str) -> None:
            pass

    trt.ILogger, trt.Logger = ILogger, Logger
    if has_monitor:
        class IProgressMonitor:
            def __init__(self) -> None:
                pass

        trt.IProgressMonitor = IProgressMonitor
    trt.Builder = lambda logger: _Builder(logger, record, build_errors)
    trt.OnnxParser = lambda network, logger: _Parser(network, parse_errors, node_names, input_shape)
    trt.Runtime = lambda logger: _Runtime(cuda)
    return trt


class _Tensor:
    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape = name, shape


class _Network:
    def __init__(self, flags: int) -> None:
        self.flags = flags
        self.inputs: list[_Tensor] = []

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def get_input(self, i: int) -> _Tensor:
        return self.inputs[i]


class _Profile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, name: str, lo: Any, opt: Any, hi: Any) -> None:
        self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))


class _TimingCache:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def serialize(self) -> bytes:
        return self.data + b"+timed"

    def combine(self, other: "_TimingCache", ignore_mismatch: bool) -> bool:
        return True


class _Config:
    def __init__(self, record: dict) -> None:
        self.record = record
        self.builder_optimization_level = 3
        self.progress_monitor = None
        self._cache: _TimingCache | None = None

    def set_memory_pool_limit(self, pool: str, size: int) -> None:
        self.record["pool"][pool] = size

    def set_flag(self, flag: str) -> None:
        self.record["set_flags"].append(flag)

    def clear_flag(self, flag: str) -> None:
        self.record["cleared_flags"].append(flag)

    def add_optimization_profile(self, profile: _Profile) -> int:
        self.record["profiles"].append(profile.shapes)
        return 0

    def create_timing_cache(self, data: bytes) -> _TimingCache | None:
        return None if data == b"garbage" else _TimingCache(bytes(data))

    def set_timing_cache(self, cache: _TimingCache, ignore_mismatch: bool) -> bool:
        self.record["timing_cache_in"] = cache.data
        self._cache = cache
        return cache.data != b"other-gpu"

    def get_timing_cache(self) -> _TimingCache | None:
        return self._cache


class _Builder:
    def __init__(self, logger: Any, record: dict, errors: tuple[str, ...]) -> None:
        self.logger, self.record, self.errors = logger, record, errors

    def create_network(self, flags: int) -> _Network:
        self.record["network_flags"] = flags
        return _Network(flags)

    def create_builder_config(self) -> _Config:
        return _Config(self.record)

    def create_optimization_profile(self) -> _Profile:
        return _Profile()

    def build_serialized_network(self, network: _Network, config: _Config) -> bytes | None:
        self.record["opt_level"] = config.builder_optimization_level
        monitor = config.progress_monitor
        if monitor is not None:
            monitor.phase_start("Building engine", None, 3)
            for step in range(3):
                self.record["monitor_calls"].append(monitor.step_complete("Building engine", step))
            monitor.phase_finish("Building engine")
        for msg in self.errors:
            self.logger.log(Severity.ERROR, msg)
        return None if self.errors else b"PLAN" + bytes(config.record["set_flags"].__repr__(), "ascii")


class _Err:
    def __init__(self, index: int, name: str, op: str, desc: str) -> None:
        self._index, self._name, self._op, self._desc = index, name, op, desc

    def desc(self) -> str:
        return self._desc

    def node(self) -> int:
        return self._index


class _NamedErr(_Err):
    def node_name(self) -> str:
        return self._name

    def node_operator(self) -> str:
        return self._op


class _Parser:
    def __init__(self, network: _Network, errors: tuple, node_names: bool, input_shape: tuple[int, ...]) -> None:
        self.network, self.node_names, self.input_shape = network, node_names, input_shape
        self.errors = [(_NamedErr if node_names else _Err)(i, *e) for i, e in enumerate(errors)]

    def parse_from_file(self, path: str) -> bool:
        self.network.inputs.append(_Tensor("x", self.input_shape))
        return not self.errors

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, i: int) -> _Err:
        return self.errors[i]


# --- TensorRT runtime: a plan whose engine computes y = 2x + 1 ---------------------------------


class _Runtime:
    def __init__(self, cuda: FakeCudaMemory | None) -> None:
        self.cuda = cuda

    def deserialize_cuda_engine(self, plan: bytes) -> "_Engine | None":
        return _Engine(self.cuda) if plan.startswith(b"PLAN") else None


class _Engine:
    num_io_tensors = 2

    def __init__(self, cuda: FakeCudaMemory | None) -> None:
        self.cuda = cuda

    def get_tensor_name(self, i: int) -> str:
        return ("x", "y")[i]

    def get_tensor_mode(self, name: str) -> str:
        return "INPUT" if name == "x" else "OUTPUT"

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (-1, 3, 4, 4)

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, ...]]:
        return [(1, 3, 4, 4), (2, 3, 4, 4), (4, 3, 4, 4)]

    def get_tensor_dtype(self, name: str) -> str:
        return "FLOAT"

    def create_execution_context(self) -> "_Context":
        return _Context(self.cuda)


class _Context:
    def __init__(self, cuda: FakeCudaMemory | None) -> None:
        self.cuda = cuda
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.executions = 0

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        if len(shape) != 4 or shape[1:] != (3, 4, 4):
            return False
        self.shapes[name] = self.shapes["y"] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        count = int(np.prod(self.shapes["x"]))
        src, dst = self.addresses["x"], self.addresses["y"]

        def compute() -> None:
            x = np.ctypeslib.as_array((ctypes.c_float * count).from_address(src))
            y = np.ctypeslib.as_array((ctypes.c_float * count).from_address(dst))
            y[:] = 2 * x + 1

        self.executions += 1
        assert self.cuda is not None
        self.cuda.enqueue(compute)
        return True
