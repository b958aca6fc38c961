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


class cudaError_t(enum.IntEnum):  # noqa: N801  (cuda-python's name)
    cudaSuccess = 0
    cudaErrorInsufficientDriver = 35
    cudaErrorNoDevice = 100
    cudaErrorStreamCaptureInvalidated = 901


def fake_cudart(built_for: int = 12060, driver: int = 12060, gpus: int = 1) -> types.ModuleType:
    """A `cuda.bindings.runtime` module: bindings built for CUDA `built_for`, driver at `driver` (1000*major+10*minor)."""
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
    return rt


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
