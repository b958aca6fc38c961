"""A stand-in for cuda-python's runtime module (`cuda.bindings.runtime`) with a chosen CUDA version pair.

It models what the doctor and CudaPythonMemory touch, the way cuda-python returns it: every call
returns a tuple whose first item is a `cudaError_t` (`cudaFree(0)` -> `(err,)`,
`cudaRuntimeGetVersion()` -> `(err, 13000)`). The runtime version is the one the bindings were
compiled for (cuda-python links the CUDA runtime statically), the driver version is the driver's;
when the first exceeds the second, CUDA initialisation fails with cudaErrorInsufficientDriver,
which is what cuda-python 13.x does on a JetPack 6 driver (CUDA 12.6).
"""

from __future__ import annotations

import enum
import sys
import types
from typing import Any

import pytest


class cudaError_t(enum.IntEnum):  # cuda-python's name
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorInsufficientDriver = 35
    cudaErrorNoDevice = 100
    cudaErrorStreamCaptureInvalidated = 901


def fake_cudart(built_for: int = 12060, driver: int = 12060, gpus: int = 1) -> types.ModuleType:
    """A `cuda.bindings.runtime` module: bindings built for CUDA `built_for`, driver at `driver`
    (1000*major+10*minor)."""
    rt = types.ModuleType("cuda.bindings.runtime")
    rt.cudaError_t = cudaError_t
    rt.last_error = cudaError_t.cudaSuccess

    def init_error() -> cudaError_t:
        if built_for > driver:
            return cudaError_t.cudaErrorInsufficientDriver
        return cudaError_t.cudaSuccess if gpus else cudaError_t.cudaErrorNoDevice

    def failing(*values: Any) -> tuple:
        err = init_error()
        if err != cudaError_t.cudaSuccess:
            rt.last_error = err
        return (err, *values)

    rt.cudaFree = lambda ptr: failing()
    rt.cudaRuntimeGetVersion = lambda: (cudaError_t.cudaSuccess, built_for)
    rt.cudaDriverGetVersion = lambda: (cudaError_t.cudaSuccess, driver)
    rt.cudaGetErrorName = lambda err: (cudaError_t.cudaSuccess, cudaError_t(err).name.encode())
    rt.cudaGetDeviceCount = lambda: failing(gpus)
    rt.cudaMemGetInfo = lambda: failing(6 << 30, 8 << 30)
    prop = types.SimpleNamespace(name=b"Orin\0\0\0", major=8, minor=7, multiProcessorCount=16,
                                 totalGlobalMem=7_990_000_000)
    rt.cudaGetDeviceProperties = lambda device: failing(prop)

    def get_last_error() -> tuple:
        err, rt.last_error = rt.last_error, cudaError_t.cudaSuccess
        return (err,)

    rt.cudaGetLastError = get_last_error
    _install_graphs(rt)
    return rt


def _install_graphs(rt: types.ModuleType) -> None:
    """Streams, capture and graphs, with the objects still alive in `live_streams`, `live_graphs`, `live_execs`
    (leak checks), and `instantiate_error` to make cudaGraphInstantiate* fail."""
    ok = cudaError_t.cudaSuccess
    rt.live_streams, rt.live_graphs, rt.live_execs = set(), set(), set()
    rt.instantiate_error = ok
    rt.cudaStreamNonBlocking = 1
    rt.cudaStreamCaptureMode = types.SimpleNamespace(cudaStreamCaptureModeThreadLocal=1)

    def create_stream(flags: int) -> tuple:
        stream = object()
        rt.live_streams.add(id(stream))
        return (ok, stream)

    def destroy(live: set) -> Any:
        def release(handle: Any) -> tuple:
            live.remove(id(handle))
            return (ok,)
        return release

    def end_capture(stream: Any) -> tuple:
        graph = object()
        rt.live_graphs.add(id(graph))
        return (ok, graph)

    def instantiate(graph: Any, flags: int) -> tuple:
        if rt.instantiate_error != ok:
            return (rt.instantiate_error, None)
        exe = object()
        rt.live_execs.add(id(exe))
        return (ok, exe)

    rt.cudaStreamCreateWithFlags = create_stream
    rt.cudaStreamDestroy = destroy(rt.live_streams)
    rt.cudaStreamBeginCapture = lambda stream, mode: (ok,)
    rt.cudaStreamEndCapture = end_capture
    rt.cudaGraphInstantiateWithFlags = instantiate
    rt.cudaGraphLaunch = lambda exe, stream: (ok,)
    rt.cudaGraphExecDestroy = destroy(rt.live_execs)
    rt.cudaGraphDestroy = destroy(rt.live_graphs)


def install_cudart(monkeypatch: pytest.MonkeyPatch, rt: types.ModuleType | None) -> None:
    """Make `from cuda.bindings import runtime` give `rt` (None: cuda-python not installed)."""
    if rt is None:
        for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart"):
            monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes the import fail
        return
    cuda, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    cuda.__path__, bindings.__path__ = [], []
    bindings.runtime, cuda.bindings = rt, bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", rt)
    monkeypatch.setitem(sys.modules, "pycuda", None)  # only cuda-python here, whatever this machine has
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
