"""The CUDA layer of a simulated device: one cuda-python release's runtime module (tests/fake_cuda_releases.py) on
host memory posing as the device profile's GPU, plus what the stand-in leaves unmodelled and the device check
reaches: the device's properties (`engines doctor`'s compute-capability check) and its versions.

The simulated TensorRT enqueues its work on the same streams (`SimCuda.enqueue_on`): a plain enqueue runs at once, an
enqueue while its stream is captured is recorded into the graph and runs on every replay, as on a GPU.
"""

from __future__ import annotations

import types
from typing import Any, Callable

from tests.fake_cuda_releases import _documented, _HostGpu, _runtime_behaviours, install_cuda_python, load_cuda_api
from tests.fake_nvidia import FakeCudaMemory
from tests.simulate.releases import Device


class ModuleSetter:
    """What install_cuda_python/install_pycuda need of a MonkeyPatch, for the life of the process."""

    @staticmethod
    def setitem(mapping: dict, key: str, value: Any) -> None:
        mapping[key] = value


class SimCuda(FakeCudaMemory):
    """The `cuda` the simulated TensorRT is given: FakeCudaMemory for anything fake_nvidia.py's classes do with it,
    and the bridge onto the simulated runtime's streams for the work an execution context enqueues."""

    def __init__(self, drop_captured_work: bool = False) -> None:
        super().__init__()
        self.gpu: _HostGpu | None = None
        self.streams: dict[int, Any] = {}  # raw cudaStream_t value -> the runtime's stream object
        self.drop_captured_work = drop_captured_work  # the "empty-capture" fault (tests/simulate/releases.FAULTS)

    def capturing_on(self, stream_handle: int) -> bool:
        """Whether the stream behind `stream_handle` is being captured into a graph."""
        stream = self.streams.get(int(stream_handle))
        return self.gpu is not None and stream is not None and id(stream) in self.gpu.capturing

    def enqueue_on(self, stream_handle: int, op: Callable[[], None]) -> None:
        """Run `op` in stream order: recorded while its stream is captured, else now (pycuda: always now)."""
        stream = self.streams.get(int(stream_handle))
        if self.gpu is None or stream is None:
            op()
        elif not (self.drop_captured_work and id(stream) in self.gpu.capturing):
            self.gpu.run(stream, op)


def device_behaviours(rt: types.ModuleType, device: Device, runtime_cuda: int) -> dict[str, Callable[..., tuple]]:
    """cudaGetDeviceProperties/Count and the two version queries, answering for `device`."""
    ok = rt.cudaError_t.cudaSuccess
    prop = types.SimpleNamespace(name=device.name.encode() + b"\0" * 8, major=device.compute_capability[0],
                                 minor=device.compute_capability[1], multiProcessorCount=device.sm_count,
                                 totalGlobalMem=device.total_memory)
    return {
        "cudaGetDeviceProperties": lambda index: (ok, prop),
        "cudaGetDeviceCount": lambda: (ok, 1),
        "cudaRuntimeGetVersion": lambda: (ok, runtime_cuda),
        "cudaDriverGetVersion": lambda: (ok, device.driver_cuda),
    }


def _stream_registry(behaviours: dict[str, Callable[..., tuple]], sim: SimCuda) -> None:
    """Wrap stream creation and destruction so a raw handle (what TensorRT gets) finds its stream again."""
    create, destroy = behaviours["cudaStreamCreateWithFlags"], behaviours["cudaStreamDestroy"]

    def created(flags: int) -> tuple:
        err, stream = create(flags)
        sim.streams[int(stream)] = stream
        return (err, stream)

    def destroyed(stream: Any) -> tuple:
        sim.streams.pop(int(stream), None)
        return destroy(stream)

    behaviours.update(cudaStreamCreateWithFlags=created, cudaStreamDestroy=destroyed)


def built_for(stem: str) -> int:
    """The CUDA version a cuda-python release is built for: cuda-python-12.6.2.post1 -> 12060."""
    major, minor = load_cuda_api(stem)["version"].split(".")[:2]
    return int(major) * 1000 + int(minor) * 10


def install_cuda_runtime(stem: str, device: Device, sim: SimCuda) -> types.ModuleType:
    """Put release `stem`'s runtime module where cuda-python puts it (only its import paths), bound to `sim`'s GPU."""
    api = load_cuda_api(stem)
    rt = install_cuda_python(ModuleSetter(), stem)
    sim.gpu = _HostGpu(device.total_memory)
    behaviours = {**_runtime_behaviours(rt, sim.gpu), **device_behaviours(rt, device, built_for(stem))}
    _stream_registry(behaviours, sim)
    ok = rt.cudaError_t.cudaSuccess
    for name, behaviour in behaviours.items():
        if name in api["functions"]:
            setattr(rt, name, _documented(name, behaviour, api["functions"][name]["returns"], ok))
    return rt
