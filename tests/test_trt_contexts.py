"""TensorRT round three (issue 22), on the stand-ins (tests/fake_nvidia.py stands in for a Jetson's TensorRT and
CUDA; tests/fake_cudart.py for cuda-python's runtime):

- one execution context per batch size when CUDA graphs are on: a graph is never replayed after its context's
  input shape changed (the fake's context holds shape state and a stale replay gives garbage, as TensorRT's);
- no CUDA object outlives its engine on any path (the fake counts buffers, pinned arrays, streams, events and
  graphs), and a graph whose instantiation fails is destroyed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engines import cuda as cuda_mem
from engines.backends.base import EngineOptions
from engines.cuda import CudaError
from kernel.errors import EdgeError
from tests.fake_nvidia import FakeCudaMemory, api_versions, fake_tensorrt
from tests.test_backend_contract import _plan, fake_backend  # noqa: F401  (the TrtEngine-on-stand-ins fixture)

BATCHED = EngineOptions(static_shapes={"x": (1, 3, 4, 4)}, max_batch=4)


@pytest.fixture
def backend(fake_backend):  # noqa: F811 - the pytest fixture imported above, used by name
    return fake_backend


def _batch(n: int) -> np.ndarray:
    return np.arange(n * 48, dtype=np.float32).reshape(n, 3, 4, 4) + n


def test_the_fake_gives_garbage_when_a_graph_is_replayed_after_its_context_changed_shape(tmp_path: Path) -> None:
    """What the old single-context engine did (set_input_shape back to 3, replay the batch-3 graph): the fake
    must catch it, or the engine test below could not fail."""
    cuda = FakeCudaMemory()
    trt = fake_tensorrt("10.3.0", cuda=cuda)
    context = trt.Runtime(trt.Logger()).deserialize_cuda_engine(b"PLAN").create_execution_context()
    x, y = cuda.malloc(4 * 48 * 4), cuda.malloc(4 * 48 * 4)
    context.set_tensor_address("x", x.ptr)
    context.set_tensor_address("y", y.ptr)
    host = np.zeros((3, 3, 4, 4), np.float32)
    out = np.zeros_like(host)

    def run(graph=None) -> np.ndarray:
        host[:] = _batch(3)
        cuda.copy_htod_async(x, host, None)
        cuda.launch_graph(graph, None) if graph is not None else context.execute_async_v3(0)
        cuda.copy_dtoh_async(out, y, None)
        return out.copy()

    assert context.set_input_shape("x", (3, 3, 4, 4))
    cuda.begin_capture(None)
    assert context.execute_async_v3(0) is False  # a capture straight after a shape change fails
    cuda.destroy_graph(cuda.end_capture(None))
    np.testing.assert_array_equal(run(), 2 * _batch(3) + 1)  # the required plain enqueue
    cuda.begin_capture(None)
    assert context.execute_async_v3(0) is True
    graph = cuda.end_capture(None)
    np.testing.assert_array_equal(run(graph), 2 * _batch(3) + 1)
    assert context.set_input_shape("x", (1, 3, 4, 4)) and context.set_input_shape("x", (3, 3, 4, 4))
    assert not np.array_equal(run(graph), 2 * _batch(3) + 1) and cuda.stale_replays == 1
    cuda.destroy_graph(graph)
    cuda.free(x)
    cuda.free(y)
    assert cuda.live() == {"buffers": 0, "pinned": 0, "streams": 0, "events": 0, "graphs": 0}


# 8.5 is never captured; 8.5/8.6 give a second context no optimization profile (tests/test_trt_profiles.py)
PER_SIZE_VERSIONS = [v for v in api_versions() if int(v.split(".")[0]) >= 10]


@pytest.mark.parametrize("version", PER_SIZE_VERSIONS)
def test_every_batch_size_has_its_own_context_and_graph_and_every_output_is_right(backend, tmp_path: Path,
                                                                                  version: str) -> None:
    cuda = FakeCudaMemory()
    engine = backend(cuda, version).TensorRTBackend().load(_plan(tmp_path), BATCHED)
    try:
        for n in (1, 4, 2, 1, 3, 4, 2):  # the device check's order, then back over sizes already captured
            np.testing.assert_array_equal(engine.infer({"x": _batch(n)})[0], 2 * _batch(n) + 1, err_msg=f"batch {n}")
        assert cuda.stale_replays == 0
        assert engine.graph_statuses == {n: "captured" for n in (1, 2, 3, 4)}
        assert engine.describe()["contexts"] == [1, 2, 3, 4]
        launches = cuda.launches
        for n in (3, 1, 4):
            np.testing.assert_array_equal(engine.infer({"x": _batch(n)})[0], 2 * _batch(n) + 1)
        assert cuda.launches == launches + 3 and cuda.stale_replays == 0  # replayed, none captured again
    finally:
        engine.close()
    assert cuda.live() == {"buffers": 0, "pinned": 0, "streams": 0, "events": 0, "graphs": 0}


@pytest.mark.parametrize("cuda_graphs,supports", [(False, True), (True, False)])
def test_without_graphs_one_context_serves_every_size(
    backend, tmp_path: Path, cuda_graphs: bool, supports: bool
) -> None:
    cuda = FakeCudaMemory(supports_graphs=supports)
    engine = backend(cuda).TensorRTBackend(cuda_graphs=cuda_graphs).load(_plan(tmp_path), BATCHED)
    try:
        for n in (1, 4, 2, 1, 3):
            np.testing.assert_array_equal(engine.infer({"x": _batch(n)})[0], 2 * _batch(n) + 1)
        assert engine.describe()["contexts"] == [3] and cuda.launches == 0  # the one context, at the size last used
    finally:
        engine.close()
    assert cuda.live()["buffers"] == 0 and cuda.live()["streams"] == 0


class _FailingSecondCapture(FakeCudaMemory):
    """end_capture fails (cudaErrorStreamCaptureInvalidated) from the second capture on."""

    def __init__(self) -> None:
        super().__init__()
        self.captures = 0

    def end_capture(self, stream):
        graph = super().end_capture(stream)
        self.captures += 1
        if self.captures > 1:
            self.destroy_graph(graph)  # the real cudaStreamEndCapture returns no graph when it fails
            raise CudaError("cudaStreamEndCapture failed: cudaErrorStreamCaptureInvalidated")
        return graph


@pytest.mark.parametrize("cuda", [FakeCudaMemory(corrupt_replay=True), _FailingSecondCapture()],
                         ids=["replay-differs", "capture-fails"])
def test_no_cuda_object_outlives_an_engine_whose_captures_failed(backend, tmp_path: Path, cuda: FakeCudaMemory) -> None:
    engine = backend(cuda).TensorRTBackend().load(_plan(tmp_path), BATCHED)
    try:
        for n in (1, 2, 3):
            engine.infer({"x": _batch(n)})
        assert any(status != "captured" for status in engine.graph_statuses.values())
    finally:
        engine.close()
    assert cuda.live() == {"buffers": 0, "pinned": 0, "streams": 0, "events": 0, "graphs": 0}


def test_no_cuda_object_outlives_an_engine_that_failed_to_load(backend, tmp_path: Path) -> None:
    cuda = FakeCudaMemory()
    with pytest.raises(EdgeError) as info:
        backend(cuda).TensorRTBackend().load(_plan(tmp_path), EngineOptions(static_shapes={"x": (1, 3, 5, 5)}))
    assert info.value.code == "MODEL_SHAPE_MISMATCH"
    assert cuda.live() == {"buffers": 0, "pinned": 0, "streams": 0, "events": 0, "graphs": 0}


def test_a_graph_whose_instantiation_fails_is_destroyed(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fake_cudart import cudaError_t, fake_cudart, install_cudart

    rt = fake_cudart()
    install_cudart(monkeypatch, rt)
    memory = cuda_mem.open_implementation("cuda-python")
    stream = memory.create_stream()
    memory.begin_capture(stream)
    rt.instantiate_error = cudaError_t.cudaErrorInvalidValue
    with pytest.raises(CudaError, match="cudaGraphInstantiate"):
        memory.end_capture(stream)
    assert rt.live_graphs == set()
    rt.instantiate_error = cudaError_t.cudaSuccess
    memory.begin_capture(stream)
    graph = memory.end_capture(stream)
    assert len(rt.live_graphs) == 1 and len(rt.live_execs) == 1
    memory.destroy_graph(graph)
    memory.destroy_stream(stream)
    assert rt.live_graphs == set() and rt.live_execs == set() and rt.live_streams == set()


def test_a_capture_that_synchronizes_fails_cleanly_and_the_engine_runs_plain(backend, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An enqueue that synchronizes its stream while captured (illegal under capture: the fake invalidates the
    capture as the CUDA runtime does) leaves a status, a plain engine that computes right, and no leak."""
    import tests.fake_nvidia as fake

    cuda = FakeCudaMemory()
    real = fake._Context.execute_async_v3

    def syncing(self, stream_handle):
        ok = real(self, stream_handle)
        cuda.synchronize(None)
        return ok

    monkeypatch.setattr(fake._Context, "execute_async_v3", syncing)
    engine = backend(cuda).TensorRTBackend().load(_plan(tmp_path), BATCHED)
    try:
        for n in (1, 3, 1):
            np.testing.assert_array_equal(engine.infer({"x": _batch(n)})[0], 2 * _batch(n) + 1)
        assert all(
            s.startswith("capture failed") and "cudaErrorStreamCapture" in s for s in engine.graph_statuses.values()
        )
        assert cuda.launches == 0
    finally:
        engine.close()
    assert cuda.live() == {"buffers": 0, "pinned": 0, "streams": 0, "events": 0, "graphs": 0}
