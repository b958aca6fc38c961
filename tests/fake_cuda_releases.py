"""Stand-ins for the CUDA layer's libraries, one per recorded release: cuda-python's runtime module
(tests/data/cuda_api/, from the published wheels) and `pycuda.driver` (tests/data/pycuda_api/, from
pycuda's sources). Each exposes only its release's names, returns values in that release's shapes,
and uses host memory posing as the GPU, so engines/cuda_mem*.py run their real code on any machine.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import json
import sys
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tests.fake_nvidia import _Guarded, _Unmodelled


# --- cuda-python's runtime module, from the published wheels' API tables ----------------------

CUDA_API_DIR = Path(__file__).resolve().parent / "data" / "cuda_api"


def cuda_api_tables() -> list[str]:
    """Every recorded cuda-python / cuda-bindings release (file stems), oldest first."""
    from packaging.version import Version  # 12.6.2.post1: a post release

    return sorted((p.stem for p in CUDA_API_DIR.glob("*.json")), key=lambda stem: Version(stem.rsplit("-", 1)[1]))


@functools.lru_cache(maxsize=None)
def load_cuda_api(stem: str) -> dict[str, Any]:
    """One table written by scripts/extract_cuda_api.py."""
    return json.loads((CUDA_API_DIR / f"{stem}.json").read_text())


class _CudaHandle:
    """cudaStream_t / cudaEvent_t / cudaGraph_t stand-in: `int(handle)` is the raw handle, as in cuda-python."""

    _next = 0x1000

    def __init__(self, payload: Any = None) -> None:
        _CudaHandle._next += 0x10
        self.value, self.payload = _CudaHandle._next, payload

    def __int__(self) -> int:
        return self.value


class _HostGpu:
    """Host memory posing as one GPU; stream work runs at once unless its stream is being captured."""

    def __init__(self, total: int) -> None:
        self.total, self.buffers, self.capturing = total, {}, {}
        self.last_error: Any = None

    def alloc(self, nbytes: int) -> int | None:
        if nbytes > self.total - sum(len(b) for b in self.buffers.values()):
            return None
        buf = ctypes.create_string_buffer(max(1, nbytes))
        self.buffers[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def run(self, stream: Any, op: Callable[[], None]) -> None:
        if id(stream) in self.capturing:
            self.capturing[id(stream)].append(op)
        else:
            op()


def fake_cuda_runtime(stem: str, total_bytes: int = 8 << 30) -> types.ModuleType:
    """The runtime module of release `stem`: only its names exist; each modelled call returns
    `(cudaError_t, *values)` with exactly as many values as that release documents."""
    api = load_cuda_api(stem)
    rt = types.ModuleType(api["source"]["module"] or "cuda.bindings.runtime")
    rt.__version__ = api["version"]
    for name in api["functions"]:
        setattr(rt, name, _Unmodelled(name))
    for name, members in api["enums"].items():
        ordered = ["cudaSuccess", *[m for m in members if m != "cudaSuccess"]] if "cudaSuccess" in members else members
        setattr(rt, name, enum.IntEnum(name, {m: i for i, m in enumerate(ordered)}))
    for name in api["constants"]:
        setattr(rt, name, 1 if name == "cudaStreamNonBlocking" else 0)  # cudaStreamNonBlocking = 0x01
    gpu, ok = _HostGpu(total_bytes), rt.cudaError_t.cudaSuccess
    for name, behaviour in _runtime_behaviours(rt, gpu).items():
        if name in api["functions"]:
            setattr(rt, name, _documented(name, behaviour, api["functions"][name]["returns"], ok))
    return rt


def _documented(name: str, behaviour: Callable[..., tuple], returns: list[str], ok: Any) -> Callable[..., tuple]:
    """Wrap a behaviour so its result has the release's documented shape: (err, *values)."""
    def call(*args: Any) -> tuple:
        err, *values = behaviour(*args)
        if len(values) != len(returns) - 1:
            raise AssertionError(f"fake {name} returns {len(values)} values; the release documents {returns}")
        return (err, *values)
    return call


def _runtime_behaviours(rt: types.ModuleType, gpu: _HostGpu) -> dict[str, Callable[..., tuple]]:
    e = rt.cudaError_t
    ok = e.cudaSuccess

    def fail(err: Any, *values: Any) -> tuple:
        gpu.last_error = err
        return (err, *values)

    def malloc(size: int) -> tuple:
        ptr = gpu.alloc(int(size))
        return (ok, ptr) if ptr is not None else fail(e.cudaErrorMemoryAllocation, None)

    def free(ptr: int) -> tuple:
        if int(ptr) == 0:
            return (ok,)
        return (ok,) if gpu.buffers.pop(int(ptr), None) is not None else fail(e.cudaErrorInvalidValue)

    def memcpy(dst: int, src: int, count: int, kind: Any, stream: Any) -> tuple:
        gpu.run(stream, lambda: ctypes.memmove(int(dst), int(src), int(count)))
        return (ok,)

    def end_capture(stream: Any) -> tuple:
        ops = gpu.capturing.pop(id(stream), None)
        return (ok, _CudaHandle(ops)) if ops is not None else fail(e.cudaErrorIllegalState, None)

    def launch(exe: Any, stream: Any) -> tuple:
        for op in exe.payload.payload:
            gpu.run(stream, op)
        return (ok,)

    def last_error() -> tuple:
        err, gpu.last_error = gpu.last_error or ok, None
        return (err,)

    clock = [0.0]

    def record(event: Any, stream: Any) -> tuple:
        clock[0] += 0.25
        event.payload = clock[0]
        return (ok,)

    used = lambda: sum(len(b) for b in gpu.buffers.values())  # noqa: E731 - the fake GPU's bytes in use, read again after each step
    return {
        "cudaFree": free, "cudaMalloc": malloc, "cudaMallocHost": malloc, "cudaFreeHost": free,
        "cudaStreamCreateWithFlags": lambda flags: (ok, _CudaHandle()), "cudaStreamDestroy": lambda s: (ok,),
        "cudaMemcpyAsync": memcpy, "cudaStreamSynchronize": lambda s: (ok,),
        "cudaEventCreate": lambda: (ok, _CudaHandle(0.0)), "cudaEventRecord": record,
        "cudaEventSynchronize": lambda ev: (ok,), "cudaEventDestroy": lambda ev: (ok,),
        "cudaEventElapsedTime": lambda a, b: (ok, float(b.payload - a.payload)),
        "cudaMemGetInfo": lambda: (ok, gpu.total - used(), gpu.total),
        "cudaStreamBeginCapture": lambda s, mode: (gpu.capturing.__setitem__(id(s), []), (ok,))[1],
        "cudaStreamEndCapture": end_capture,
        "cudaGraphInstantiate": lambda g, flags: (ok, _CudaHandle(g)),
        "cudaGraphInstantiateWithFlags": lambda g, flags: (ok, _CudaHandle(g)),
        "cudaGraphLaunch": launch, "cudaGraphExecDestroy": lambda x: (ok,), "cudaGraphDestroy": lambda g: (ok,),
        "cudaGetErrorName": lambda err: (ok, rt.cudaError_t(err).name.encode()),
        "cudaGetLastError": last_error,
        "cudaRuntimeGetVersion": lambda: (ok, 12060), "cudaDriverGetVersion": lambda: (ok, 12060),
    }


def install_cuda_python(monkeypatch: Any, stem: str) -> types.ModuleType:
    """Make `cuda.bindings.runtime` and/or `cuda.cudart` importable exactly where release `stem` has them."""
    api, rt = load_cuda_api(stem), fake_cuda_runtime(stem)
    cuda, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    cuda.__path__, bindings.__path__ = [], []
    has_bindings, has_cudart = (
        api["import_paths"]["cuda.bindings.runtime"] is True,
        api["import_paths"]["cuda.cudart"] is True,
    )
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings if has_bindings else None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", rt if has_bindings else None)
    monkeypatch.setitem(sys.modules, "cuda.cudart", rt if has_cudart else None)
    if has_bindings:
        bindings.runtime, cuda.bindings = rt, bindings
    if has_cudart:
        cuda.cudart = rt
    return rt


# --- pycuda.driver, from each release's sources (no release has stream capture) ----------------

PYCUDA_API_DIR = Path(__file__).resolve().parent / "data" / "pycuda_api"


def pycuda_api_tables() -> list[str]:
    """Every recorded pycuda release (file stems), oldest first."""
    return sorted((p.stem for p in PYCUDA_API_DIR.glob("*.json")),
                  key=lambda s: tuple(int(x) for x in s.split("-", 1)[1].split(".")))


class PycudaTable:
    """One pycuda release's table, with the interface _Guarded reads (`members`, `version`)."""

    def __init__(self, stem: str) -> None:
        self.data = json.loads((PYCUDA_API_DIR / f"{stem}.json").read_text())
        self.version = f"pycuda {self.data['version']}"

    def members(self, cls: str) -> set[str]:
        return set(self.data["classes"].get(cls, ()))


def fake_pycuda(stem: str, total_bytes: int = 8 << 30) -> tuple[types.ModuleType, types.ModuleType]:
    """(`pycuda`, `pycuda.driver`) of release `stem`: only its names, host memory posing as the GPU."""
    api = PycudaTable(stem)
    drv = types.ModuleType("pycuda.driver")
    for name in api.data["functions"] + list(api.data["classes"]):
        setattr(drv, name, _Unmodelled(name))
    errors = _pycuda_errors(api)
    for name, cls in errors.items():
        setattr(drv, name, cls)
    for name, members in api.data["enums"].items():
        setattr(drv, name, enum.IntEnum(name, {m: i for i, m in enumerate(members)}))
    gpu = _HostGpu(total_bytes)
    for name, value in _pycuda_behaviour(api, gpu, errors).items():
        if name in api.data["functions"] or name in api.data["classes"]:
            setattr(drv, name, value)
    package = types.ModuleType("pycuda")
    package.__path__, package.driver = [], drv
    return package, drv


def _pycuda_errors(api: PycudaTable) -> dict[str, type]:
    """pycuda's exceptions: Error, and the others derived from it (DECLARE_EXC(X, CudaError))."""
    base = type("Error", (Exception,), {})
    return {name: base if name == "Error" else type(name, (base,), {}) for name in api.data["exceptions"]}


def _pycuda_behaviour(api: PycudaTable, gpu: _HostGpu, errors: dict[str, type]) -> dict[str, Any]:
    class Context(_Guarded):
        API = "Context"

        def push(self) -> None:
            pass

        def detach(self) -> None:
            pass

        @staticmethod
        def pop() -> None:
            pass

    class Device(_Guarded):
        API = "Device"

        def __init__(self, number: int) -> None:
            super().__init__(api)

        def retain_primary_context(self) -> Context:
            return Context(api)

        def compute_capability(self) -> tuple[int, int]:
            return (8, 7)

        def name(self) -> str:
            return "stand-in GPU"

        def total_memory(self) -> int:
            return gpu.total

    class DeviceAllocation(_Guarded):
        API = "DeviceAllocation"

        def __init__(self, ptr: int) -> None:
            super().__init__(api)
            self._ptr = ptr

        def __int__(self) -> int:
            return self._ptr

        def free(self) -> None:
            gpu.buffers.pop(self._ptr, None)

    class PagelockedHostAllocation(_Guarded):
        API = "PagelockedHostAllocation"

        def __init__(self, shape: tuple, dtype: Any) -> None:
            super().__init__(api)
            self._ptr = gpu.alloc(max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize))
            self.__array_interface__ = {"shape": tuple(shape), "typestr": np.dtype(dtype).str,
                                        "data": (self._ptr, False), "version": 3}

        def free(self) -> None:
            gpu.buffers.pop(self._ptr, None)

    class Stream(_Guarded):
        API = "Stream"

        def __init__(self, flags: int = 0) -> None:
            super().__init__(api)
            self._handle = _CudaHandle()

        handle = property(lambda self: int(self._handle))

        def synchronize(self) -> None:
            pass

    clock = [0.0]

    class Event(_Guarded):
        API = "Event"

        def __init__(self, flags: int | None = None) -> None:
            super().__init__(api)
            self._at = 0.0

        def record(self, stream: Any = None) -> "Event":
            clock[0] += 0.25
            self._at = clock[0]
            return self

        def synchronize(self) -> "Event":
            return self

        def time_since(self, event: "Event") -> float:
            return self._at - event._at

        def time_till(self, event: "Event") -> float:
            return event._at - self._at

    def mem_alloc(nbytes: int) -> DeviceAllocation:
        ptr = gpu.alloc(int(nbytes))
        if ptr is None:
            raise errors["MemoryError"]("cuMemAlloc failed: out of memory")
        return DeviceAllocation(ptr)

    def copy(dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    used = lambda: sum(len(b) for b in gpu.buffers.values())  # noqa: E731 - the fake GPU's bytes in use, read again after each step
    return {
        "init": lambda flags=0: None, "Device": Device, "Context": Context, "Stream": Stream, "Event": Event,
        "mem_alloc": mem_alloc, "mem_get_info": lambda: (gpu.total - used(), gpu.total),
        "pagelocked_empty": lambda shape, dtype, order="C", mem_flags=0: np.asarray(
            PagelockedHostAllocation(tuple(shape), dtype)),
        "memcpy_htod_async": lambda dest, src, stream=None: copy(int(dest), src.ctypes.data, src.nbytes),
        "memcpy_dtoh_async": lambda dest, src, stream=None: copy(dest.ctypes.data, int(src), dest.nbytes),
        "get_version": lambda: (12, 6, 0), "get_driver_version": lambda: 12060,
    }


def install_pycuda(monkeypatch: Any, stem: str) -> types.ModuleType:
    """Make `import pycuda.driver` give release `stem`'s stand-in (and cuda-python absent)."""
    package, drv = fake_pycuda(stem)
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
    return drv
