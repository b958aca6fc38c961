"""TensorRT runtime defects of issue 9, each reproduced on the stand-ins (tests/fake_nvidia.py, fake_cudart.py):

- `trt.nptype` crashes on TensorRT 8.5.2 with numpy >= 1.24 (np.bool, NVIDIA/TensorRT#2557) and raises
  TypeError for BF16/FP8 I/O tensors;
- a failed CUDA-graph capture left the CUDA runtime's sticky error behind;
- the pycuda implementation claimed CUDA graphs through an API no released pycuda has;
- in-process builds lost TensorRT's error text once a Runtime's logger existed (one logger per process).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines import cuda as cuda_mem
from engines.backends.base import EngineOptions
from engines.backends.tensorrt_compat import numpy_dtype, shared_logger
from engines.build.spec import EngineBuildError, EngineBuildSpec
from engines.cuda import CudaError
from kernel.errors import ModelError
from tests.fake_nvidia import (FakeCudaMemory, api_versions, fake_tensorrt, forget_tensorrt_backend,
                               import_tensorrt_backend, load_api)

STATIC = EngineOptions(static_shapes={"x": (1, 3, 4, 4)})


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch):
    """Import engines.backends.tensorrt_backend against a given fake tensorrt module and fake CUDA."""

    def install(trt: types.ModuleType, cuda: FakeCudaMemory):
        return import_tensorrt_backend(monkeypatch, trt, cuda)

    yield install
    forget_tensorrt_backend()


def _plan(tmp_path: Path) -> Path:
    path = tmp_path / "e.plan"
    path.write_bytes(b"PLAN-fake")
    return path


# --- dtypes --------------------------------------------------------------------------------------


def test_tensorrt_85_with_numpy_124_loads_and_runs_without_trt_nptype(backend, tmp_path: Path) -> None:
    cuda = FakeCudaMemory()
    trt = fake_tensorrt("8.5.2", cuda=cuda)

    def nptype(dtype: Any) -> Any:  # what 8.5.2's own nptype does under numpy >= 1.24 (its table names np.bool)
        raise AttributeError("module 'numpy' has no attribute 'bool'")

    trt.nptype = nptype
    engine = backend(trt, cuda).TensorRTBackend().load(_plan(tmp_path), STATIC)
    x = np.ones((1, 3, 4, 4), np.float32)
    np.testing.assert_array_equal(engine.infer({"x": x})[0], 3 * x)
    assert engine.graph_status.startswith("skipped: capturing execute_async_v3") and cuda.launches == 0
    engine.close()


class _Bf16Output:
    """Wraps a fake engine so its output tensor is BF16, as a model exported with bf16 outputs is."""

    def __init__(self, engine: Any, trt: Any) -> None:
        self._engine, self._trt = engine, trt

    def get_tensor_dtype(self, name: str) -> Any:
        return self._trt.DataType.BF16 if name == "y" else self._engine.get_tensor_dtype(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def test_bf16_output_is_a_model_error_naming_the_tensor(backend, tmp_path: Path) -> None:
    trt = fake_tensorrt("10.3.0")
    runtime = trt.Runtime

    def bf16_runtime(logger: Any) -> Any:
        inner = runtime(logger)
        return types.SimpleNamespace(deserialize_cuda_engine=lambda plan: _Bf16Output(
            inner.deserialize_cuda_engine(plan), trt))

    trt.Runtime = bf16_runtime
    cuda = FakeCudaMemory()
    with pytest.raises(ModelError) as err:
        backend(trt, cuda).TensorRTBackend().load(_plan(tmp_path), STATIC)
    assert err.value.code == "MODEL_DTYPE_UNSUPPORTED" and "'y' is BF16" in str(err.value)
    assert cuda.closed  # the half-built engine released what it had allocated


@pytest.mark.parametrize("version", api_versions())
def test_every_tensorrt_datatype_maps_or_is_refused_clearly(version: str) -> None:
    trt = fake_tensorrt(version)
    for member in trt.DataType:
        try:
            dtype = numpy_dtype(member, "t")
        except ModelError as exc:
            assert member.name in {"BF16", "FP8", "INT4", "FP4", "E8M0"} and exc.code == "MODEL_DTYPE_UNSUPPORTED"
        else:
            assert dtype.itemsize >= 1 and member.name not in {"BF16", "FP8"}
    assert "DataType" in load_api(version).enums


# --- CUDA graphs ---------------------------------------------------------------------------------


class InvalidatedCapture(FakeCudaMemory):
    """Capture ends in cudaErrorStreamCaptureInvalidated, which stays as the runtime's last error."""

    def __init__(self) -> None:
        super().__init__()
        self.sticky: str | None = None
        self.cleared: list[str] = []

    def end_capture(self, stream: Any) -> Any:
        super().end_capture(stream)
        self.sticky = "cudaErrorStreamCaptureInvalidated"
        raise CudaError("cudaStreamEndCapture failed: cudaErrorStreamCaptureInvalidated")

    def clear_error(self) -> str | None:
        error, self.sticky = self.sticky, None
        if error:
            self.cleared.append(error)
        return error


def test_failed_capture_clears_the_cuda_error_and_runs_plain(backend, tmp_path: Path) -> None:
    cuda = InvalidatedCapture()
    engine = backend(fake_tensorrt("10.3.0", cuda=cuda), cuda).TensorRTBackend().load(_plan(tmp_path), STATIC)
    assert cuda.cleared == ["cudaErrorStreamCaptureInvalidated"] and cuda.sticky is None
    assert engine.graph_status.startswith("capture failed") and "cleared CUDA error" in engine.graph_status
    x = np.ones((1, 3, 4, 4), np.float32)
    np.testing.assert_array_equal(engine.infer({"x": x})[0], 3 * x)
    engine.close()


def test_cuda_python_clear_error_reads_and_resets_the_last_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fake_cudart import cudaError_t, fake_cudart, install_cudart

    rt = fake_cudart()
    install_cudart(monkeypatch, rt)
    memory = cuda_mem.open_implementation("cuda-python")
    rt.last_error = cudaError_t.cudaErrorStreamCaptureInvalidated
    assert memory.clear_error() == "cudaErrorStreamCaptureInvalidated (cuda-python)"
    assert memory.clear_error() is None


def test_pycuda_never_claims_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a pycuda built from the unmerged capture PR (Stream.begin_capture present) is not used for graphs."""
    driver = types.ModuleType("pycuda.driver")

    class Error(Exception):
        pass

    class Stream:
        def begin_capture(self, mode: Any) -> None:  # from the unmerged PR; never called
            raise AssertionError("graph path used")

    driver.Error, driver.Stream = Error, Stream
    driver.init = lambda: None
    driver.Device = lambda n: types.SimpleNamespace(
        retain_primary_context=lambda: types.SimpleNamespace(detach=lambda: None)
    )
    package = types.ModuleType("pycuda")
    package.driver = driver
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)
    monkeypatch.delitem(sys.modules, "engines.cuda.pycuda_memory", raising=False)
    memory = importlib.import_module("engines.cuda.pycuda_memory").PyCudaMemory()
    assert memory.supports_graphs is False
    with pytest.raises(CudaError, match="no stream capture"):
        memory.begin_capture(Stream())
    sys.modules.pop("engines.cuda.pycuda_memory", None)


# --- one logger per process ----------------------------------------------------------------------


def _first_logger_wins(trt: Any) -> list:
    """Make the fake behave like TensorRT: the first logger given to a Runtime/Builder is the one used."""
    first: list = []
    runtime, builder = trt.Runtime, trt.Builder

    def keep(logger: Any) -> Any:
        if not first:
            first.append(logger)
        return first[0]

    trt.Runtime = lambda logger: runtime(keep(logger))
    trt.Builder = lambda logger: builder(keep(logger))
    return first


def test_build_after_a_runtime_still_reports_tensorrt_errors(backend, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.build import tensorrt as tensorrt_build

    cuda = FakeCudaMemory()
    trt = fake_tensorrt("10.3.0", cuda=cuda,
                        build_errors=("Error Code 2: Internal Error (Assertion failed: out of memory)",))
    first = _first_logger_wins(trt)
    engine = backend(trt, cuda).TensorRTBackend().load(_plan(tmp_path), STATIC)  # a Runtime exists now
    assert first == [shared_logger(trt)]
    monkeypatch.setattr(tensorrt_build, "free_device_memory", lambda: None)
    spec = EngineBuildSpec(precision="fp32", input_shapes={"x": (1, 3, 4, 4)})
    with pytest.raises(EngineBuildError) as err:
        tensorrt_build.build_serialized(trt, tmp_path / "m.onnx", spec, None, lambda *a, **k: None)
    assert "Assertion failed: out of memory" in str(err.value) and err.value.code == "ENGINE_BUILD_OOM"
    engine.close()


def test_a_build_reports_only_its_own_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.build import tensorrt as tensorrt_build

    monkeypatch.setattr(tensorrt_build, "free_device_memory", lambda: None)
    trt = fake_tensorrt("10.3.0", build_errors=("second build failed",))
    logger = shared_logger(trt)
    logger.log(trt.ILogger.Severity.ERROR, "an earlier engine's error")
    spec = EngineBuildSpec(precision="fp32", input_shapes={"x": (1, 3, 4, 4)})
    with pytest.raises(EngineBuildError) as err:
        tensorrt_build.build_serialized(trt, tmp_path / "m.onnx", spec, None, lambda *a, **k: None)
    assert "second build failed" in str(err.value) and "earlier" not in str(err.value)
