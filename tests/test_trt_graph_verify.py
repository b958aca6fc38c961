"""CUDA-graph verification and the CUDA error left by a failed capture (issue 41), on the stand-ins:

- a capture that recorded nothing must not pass verification: the verification replay used the same inputs
  while the device outputs still held the plain run's result, so an empty graph "reproduced" it and every
  later frame returned that first result (probe: x = 5 gave 1.0 instead of 11);
- `CudaPythonMemory.clear_error` resets the last error in every runtime instance it can reach: cuda-python's
  own (a driver-API reimplementation up to 12.8, a statically linked cudart from 12.9: private either way), and
  a shared libcudart that is already loaded in the process, never loading one itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines import cuda as cuda_mem
from engines.backends.base import EngineOptions
from tests.fake_nvidia import FakeCudaMemory, api_versions, fake_tensorrt
from tests.test_backend_contract import _plan, fake_backend  # noqa: F401  (the TrtEngine-on-stand-ins fixture)

STATIC = EngineOptions(static_shapes={"x": (1, 3, 4, 4)})
CAPTURING = [v for v in api_versions() if v != "8.5.2"]  # 8.5 is never captured


@pytest.fixture
def backend(fake_backend):  # noqa: F811 - the pytest fixture imported above, used by name
    return fake_backend


def test_the_fakes_empty_capture_records_nothing() -> None:
    cuda = FakeCudaMemory(empty_capture=True)
    trt = fake_tensorrt("10.3.0", cuda=cuda)
    context = trt.Runtime(None).deserialize_cuda_engine(b"PLAN").create_execution_context()
    x, y = cuda.malloc(48 * 4), cuda.malloc(48 * 4)
    context.set_tensor_address("x", x.ptr)
    context.set_tensor_address("y", y.ptr)
    assert context.set_input_shape("x", (1, 3, 4, 4)) and context.execute_async_v3(0)  # the plain enqueue
    cuda.begin_capture(None)
    assert context.execute_async_v3(0) is True  # "succeeds" ...
    graph = cuda.end_capture(None)
    assert graph[1] == []  # ... and put nothing in the graph
    cuda.destroy_graph(graph)


@pytest.mark.parametrize("version", CAPTURING)
def test_an_empty_capture_does_not_pass_verification(backend, tmp_path: Path, version: str) -> None:
    """Fails before issue 41: the status was "captured" and x = 5 returned 1.0 (the zeros' plain-run result)."""
    cuda = FakeCudaMemory(empty_capture=True)
    engine = backend(cuda, version).TensorRTBackend().load(_plan(tmp_path), STATIC)
    try:
        assert engine.graph_status == "graph replay differs from a plain run"
        assert engine.describe()["cuda_graph"] is False and cuda.live()["graphs"] == 0
        x = np.full((1, 3, 4, 4), 5, np.float32)
        np.testing.assert_array_equal(engine.infer({"x": x})[0], np.full_like(x, 11))
    finally:
        engine.close()


def test_an_empty_capture_of_any_batch_size_is_dropped(backend, tmp_path: Path) -> None:
    cuda = FakeCudaMemory(empty_capture=True)
    engine = backend(cuda, "10.3.0").TensorRTBackend().load(_plan(tmp_path), EngineOptions(
        static_shapes={"x": (1, 3, 4, 4)}, max_batch=4))
    try:
        for n in (1, 4, 2, 1, 3):
            x = np.full((n, 3, 4, 4), float(n), np.float32)
            np.testing.assert_array_equal(engine.infer({"x": x})[0], 2 * x + 1)
        assert set(engine.graph_statuses.values()) == {"graph replay differs from a plain run"}
        assert engine.describe()["cuda_graph"] is False and cuda.live()["graphs"] == 0
    finally:
        engine.close()


@pytest.mark.parametrize("version", CAPTURING)
def test_a_real_capture_still_passes(backend, tmp_path: Path, version: str) -> None:
    """The poisoned verification replay passes a graph that computes: also when the plain result is all
    0xA5 bytes, the first pattern tried (another pattern is used then)."""
    cuda = FakeCudaMemory()
    module = backend(cuda, version)
    pattern = np.frombuffer(b"\xa5" * 4, np.float32)[0]
    assert module._poison_byte(np.full((2,), pattern, np.float32)) != 0xA5
    engine = module.TensorRTBackend().load(_plan(tmp_path), STATIC)
    try:
        assert engine.graph_status == "captured"
        x = np.full((1, 3, 4, 4), 5, np.float32)
        np.testing.assert_array_equal(engine.infer({"x": x})[0], np.full_like(x, 11))
        assert cuda.launches >= 2  # the verification replay and this frame's
    finally:
        engine.close()


# --- clear_error: which runtime's last error ---------------------------------------------------------------


class _SharedCudart:
    """A shared libcudart already loaded in the process, holding a last error (ctypes-like calls)."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.cudaGetErrorName = _ErrorName()

    def cudaGetLastError(self) -> int:
        error, self.error = self.error, 0
        return error


class _ErrorName:
    restype: Any = None

    def __call__(self, code: int) -> bytes:
        return {901: b"cudaErrorStreamCaptureInvalidated"}.get(code, b"cudaErrorUnknown")


def test_clear_error_also_resets_a_shared_cudart_already_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails before issue 41: only cuda-python's own runtime was reset, which is never the runtime another library
    in the process links (cuda-python's is private on every release)."""
    from engines.cuda import cuda_python
    from tests.fake_cudart import cudaError_t, fake_cudart, install_cudart

    rt = fake_cudart()
    install_cudart(monkeypatch, rt)
    shared = _SharedCudart(901)
    monkeypatch.setattr(cuda_python, "loaded_shared_cudarts", lambda: [("libcudart.so.12", shared)])
    memory = cuda_mem.open_implementation("cuda-python")
    rt.last_error = cudaError_t.cudaErrorStreamCaptureInvalidated
    assert memory.clear_error() == ("cudaErrorStreamCaptureInvalidated (cuda-python); "
                                    "cudaErrorStreamCaptureInvalidated (libcudart.so.12)")
    assert shared.error == 0 and rt.last_error == cudaError_t.cudaSuccess
    assert memory.clear_error() is None


def test_finding_shared_cudarts_loads_none() -> None:
    from engines.cuda.cuda_python import loaded_shared_cudarts

    def mapped() -> bool:
        return "libcudart.so" in Path("/proc/self/maps").read_text()

    before = mapped()
    found = loaded_shared_cudarts()
    assert mapped() == before and (found != []) == before
