"""One contract for every engine backend, run over each one enabled here (skipped with its reason otherwise).

ONNX Runtime runs it for real on any machine; TensorRT runs it wherever `tensorrt` imports and a CUDA
memory implementation reaches a GPU. The second half drives the TensorRT runtime (TrtEngine) and its batching
through recording stand-ins (tests/fake_nvidia.py) that expose exactly the API of each TensorRT release in
tests/data/tensorrt_api/ (8.5.2 to 11.x, generated from NVIDIA's binding sources), so their control flow is
tested on every machine, and a name a release lacks fails here. The build logic on the same stand-ins:
test_trt_build_logic.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engines import cuda as cuda_mem
from engines.backends import BACKENDS, get_backend
from engines.backends.base import Engine, EngineOptions
from engines.build import tensorrt as tb  # needs no tensorrt import
from kernel.errors import EdgeError
from engines.build.provisioning import load_provisioned, provision
from engines.runtime.engine_files import load_engine_file
from kernel.registry import import_plugins
from tests.engine_fixtures import conv_model, source
from engines.evaluation.frames import text_frames
from engines.model.preprocess import Preprocessor
from tests.fake_nvidia import (FakeCudaMemory, api_versions, fake_tensorrt, forget_tensorrt_backend,
                               import_tensorrt_backend)


BACKEND_NAMES = ("onnxruntime", "tensorrt")
SIZE = 32


def _skip_reason(name: str) -> str | None:
    if name not in BACKENDS:
        return f"{name} disabled here: {BACKENDS.disabled().get(name, 'not registered')}"
    if name == "tensorrt":
        available = cuda_mem.availability()
        if all(reason is not None for reason in available.values()):
            return f"tensorrt imports but no CUDA memory implementation works: {available}"
    return None


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def backend_name(request: pytest.FixtureRequest) -> str:
    reason = _skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture(scope="module")
def built(backend_name: str, tmp_path_factory: pytest.TempPathFactory):
    """One fp32 engine per backend, shared by the contract tests (each leaves it usable)."""
    tmp_path = tmp_path_factory.mktemp(f"contract-{backend_name}")
    src = source(conv_model(tmp_path / "tiny.onnx"), size=SIZE)
    result = provision(src, backend=backend_name, cache_dir=tmp_path / "cache", db_path=tmp_path / "state.db",
                       validation_samples=2, latency_runs=3)
    runtime = load_provisioned(result, src)
    yield result, src, runtime
    runtime.close()


def _reference(onnx_path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


# --- the contract -----------------------------------------------------------------------------


def test_backend_reports_its_version(backend_name: str) -> None:
    version = get_backend(backend_name).version()
    assert isinstance(version, str) and version[0].isdigit()


def test_engine_io_is_name_based_and_pinned_to_the_preprocess_size(built) -> None:
    result, _, runtime = built
    engine = runtime.engine
    assert isinstance(engine, Engine) and engine.backend == result.backend
    assert [(i.name, i.shape, i.dtype) for i in engine.inputs] == [("x", (1, 3, SIZE, SIZE), "float32")]
    assert [(o.name, o.shape) for o in engine.outputs] == [("y", (1, 4, SIZE, SIZE))]
    assert result.validation.passed and result.validation.accuracy >= 0.99


def test_outputs_match_the_fp32_onnx_reference(built) -> None:
    result, src, runtime = built
    x = np.random.default_rng(3).normal(size=(1, 3, SIZE, SIZE)).astype(np.float32)
    out = runtime.engine.infer({"x": x})
    assert len(out) == 1 and out[0].dtype == np.float32
    np.testing.assert_allclose(out[0], _reference(src.onnx_path, x), rtol=1e-4, atol=1e-4)
    again = runtime.engine.infer({"x": x * 0})  # outputs are the caller's: a new run must not change them
    assert not np.array_equal(out[0], again[0])


def test_describe_and_idempotent_close(built) -> None:
    result, src, runtime = built
    info = runtime.engine.describe()
    assert info["backend"] == result.backend and info["precision"] == "fp32"
    assert info["inputs"][0]["name"] == "x" and info["outputs"][0]["name"] == "y"
    own = load_provisioned(result, src)  # close a separate instance: the shared one stays usable
    own.close()
    own.close()


def test_a_missing_input_is_an_inference_error(built) -> None:
    _, _, runtime = built
    with pytest.raises(EdgeError) as info:
        runtime.engine.infer({"not_x": np.zeros((1, 3, SIZE, SIZE), np.float32)})
    assert info.value.code == "INFERENCE_FAILED"


def test_an_unloadable_engine_file_is_engine_incompatible(built, tmp_path: Path) -> None:
    result, _, _ = built
    broken = tmp_path / f"broken{result.engine_path.suffix}"
    broken.write_bytes(result.engine_path.read_bytes()[: 64])
    with pytest.raises(EdgeError) as info:
        load_engine_file(broken, result.backend, "fp32", result.providers, result.input_shapes)
    assert info.value.code == "ENGINE_INCOMPATIBLE"


def _held_out_inputs(src, count: int = 6) -> list[np.ndarray]:
    """Preprocessed frames from another seed than the calibration set's: inputs the quantizer never saw."""
    pre, out = Preprocessor(src.manifest.preprocess), []
    for frame in text_frames(SIZE, SIZE, count, seed=12345):
        pre(frame)
        out.append(pre.tensor.copy())
    return out


def test_int8_engine_agrees_with_fp32(backend_name: str, tmp_path: Path) -> None:
    """The INT8 engine's own outputs against ONNX Runtime FP32 on the original model, compared here."""
    src = source(conv_model(tmp_path / "tiny.onnx"), size=SIZE)
    result = provision(src, backend=backend_name, precision="int8", cache_dir=tmp_path / "cache",
                       db_path=tmp_path / "state.db", validation_samples=2, latency_runs=3)
    assert result.precision == "int8"
    runtime = load_provisioned(result, src)
    try:
        pairs = [(runtime.engine.infer({"x": x})[0], _reference(src.onnx_path, x)) for x in _held_out_inputs(src)]
    finally:
        runtime.close()
    got, want = np.concatenate([g.ravel() for g, _ in pairs]), np.concatenate([w.ravel() for _, w in pairs])
    rel_l2 = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert rel_l2 < 0.05 and cosine > 0.998, f"int8 vs fp32: relative L2 {rel_l2:.4f}, cosine {cosine:.5f}"
    assert not np.array_equal(got, want), "int8 outputs are bit-identical to fp32: nothing was quantized"


# --- TensorRT runtime (TrtEngine) on the stand-ins ---------------------------------------------


@pytest.fixture
def fake_backend(monkeypatch: pytest.MonkeyPatch):
    """Import engines.backends.tensorrt_backend against fake tensorrt + a given fake CUDA; registry restored after."""

    def install(cuda: FakeCudaMemory, version: str = "10.3.0"):
        return import_tensorrt_backend(monkeypatch, fake_tensorrt(version, cuda=cuda), cuda)

    yield install
    forget_tensorrt_backend()


def _plan(tmp_path: Path) -> Path:
    path = tmp_path / "e.plan"
    path.write_bytes(b"PLAN-fake")
    return path


@pytest.mark.parametrize("version", api_versions())
def test_trt_engine_binds_by_name_and_replays_a_cuda_graph(fake_backend, tmp_path: Path, version: str) -> None:
    cuda = FakeCudaMemory()
    module = fake_backend(cuda, version)
    engine = module.TensorRTBackend().load(_plan(tmp_path), EngineOptions(static_shapes={"x": (1, 3, 4, 4)}))
    assert [(i.name, i.shape) for i in engine.inputs] == [("x", (1, 3, 4, 4))]
    assert [(o.name, o.shape) for o in engine.outputs] == [("y", (1, 3, 4, 4))]
    graphs = version != "8.5.2"  # the product skips capture on 8.5, where capturing execute_async_v3 fails
    assert (engine.graph_status == "captured") == graphs and engine.describe()["cuda_graph"] is graphs
    x = np.arange(48, dtype=np.float32).reshape(1, 3, 4, 4)
    launches = cuda.launches
    np.testing.assert_array_equal(engine.infer({"x": x})[0], 2 * x + 1)
    assert cuda.launches == launches + int(graphs)
    engine.close()
    engine.close()
    assert cuda.closed


def test_trt_engine_uses_profile_opt_shape_without_a_static_shape(fake_backend, tmp_path: Path) -> None:
    module = fake_backend(FakeCudaMemory())
    engine = module.TensorRTBackend().load(_plan(tmp_path), EngineOptions())
    assert engine.inputs[0].shape == (2, 3, 4, 4)
    engine.close()


@pytest.mark.parametrize("cuda_kwargs,graphs,status", [
    ({"supports_graphs": False}, True, "fake has no stream capture"),
    ({"corrupt_replay": True}, True, "graph replay differs from a plain run"),
    ({}, False, "disabled by configuration"),
])
def test_trt_engine_falls_back_to_plain_enqueue(fake_backend, tmp_path: Path, cuda_kwargs: dict, graphs: bool,
                                                status: str) -> None:
    module = fake_backend(FakeCudaMemory(**cuda_kwargs))
    engine = module.TensorRTBackend(cuda_graphs=graphs).load(_plan(tmp_path),
                                                             EngineOptions(static_shapes={"x": (1, 3, 4, 4)}))
    assert engine.graph_status == status and engine.describe()["cuda_graph"] is False
    x = np.ones((1, 3, 4, 4), np.float32)
    np.testing.assert_array_equal(engine.infer({"x": x})[0], 3 * x)
    engine.close()


def test_tensorrt_without_cuda_bindings_is_disabled_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("10.3.0"))
    monkeypatch.setattr(cuda_mem, "missing_bindings", lambda: "neither cuda-python nor pycuda is installed")
    monkeypatch.delitem(sys.modules, "engines.backends.tensorrt_backend", raising=False)
    monkeypatch.setattr(BACKENDS, "_plugins", {k: v for k, v in BACKENDS._plugins.items() if k != "tensorrt"})
    monkeypatch.setattr(BACKENDS, "_disabled", {})
    import_plugins(BACKENDS, "engines.backends", [("tensorrt", "tensorrt_backend")])
    assert "tensorrt" not in BACKENDS and "cuda-python" in BACKENDS.disabled()["tensorrt"]
    sys.modules.pop("engines.backends.tensorrt_backend", None)


def test_trt_engine_errors_are_typed(fake_backend, tmp_path: Path) -> None:
    cuda = FakeCudaMemory()
    module = fake_backend(cuda)
    bad = tmp_path / "bad.plan"
    bad.write_bytes(b"not a plan")
    with pytest.raises(EdgeError) as info:
        module.TensorRTBackend().load(bad, EngineOptions())
    assert info.value.code == "ENGINE_INCOMPATIBLE" and cuda.closed
    cuda.closed = False
    with pytest.raises(EdgeError) as info:
        module.TensorRTBackend().load(_plan(tmp_path), EngineOptions(static_shapes={"x": (1, 3, 5, 5)}))
    assert info.value.code == "MODEL_SHAPE_MISMATCH" and cuda.closed
    engine = module.TensorRTBackend().load(_plan(tmp_path), EngineOptions(static_shapes={"x": (1, 3, 4, 4)}))
    with pytest.raises(EdgeError) as info:
        engine.infer({"x": np.zeros((1, 3, 5, 5), np.float32)})
    assert info.value.code == "INFERENCE_FAILED"
    engine.close()
    with pytest.raises(EdgeError) as info:
        engine.infer({"x": np.zeros((1, 3, 4, 4), np.float32)})
    assert info.value.code == "INFERENCE_FAILED"


# --- batching: TensorRT optimisation profile and per-size CUDA graphs (issue 10) ------------------------


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tb, "free_device_memory", lambda: None)


@pytest.mark.parametrize("version", api_versions())
def test_batch_profile_is_min_one_opt_and_max_the_batch_size(fake_backend, no_gpu, tmp_path: Path,
                                                             version: str) -> None:
    """plan_build for TensorRT with max_batch 4 -> the build's profile is min 1, opt = max = 4 (same H, W)."""
    from engines.build.provisioning import plan_build

    fake_backend(FakeCudaMemory(), version)
    src = source(conv_model(tmp_path / "tiny.onnx"), size=16)
    plan = plan_build(src, "tensorrt", max_batch=4, fingerprint_root=tmp_path)
    assert plan.spec.max_batch == 4 and plan_build(src, "tensorrt", fingerprint_root=tmp_path).key.key != plan.key.key
    trt = fake_tensorrt(version, input_shape=(-1, 3, -1, -1))
    tb.build_serialized(trt, tmp_path / "m.onnx", plan.spec, None, lambda *a, **k: None)
    assert trt._record["profiles"] == [{"x": ((1, 3, 16, 16), (4, 3, 16, 16), (4, 3, 16, 16))}]


@pytest.mark.parametrize("version", api_versions())
def test_trt_engine_runs_batches_with_one_graph_per_size(fake_backend, tmp_path: Path, version: str) -> None:
    cuda = FakeCudaMemory()
    module = fake_backend(cuda, version)
    engine = module.TensorRTBackend().load(_plan(tmp_path),
                                           EngineOptions(static_shapes={"x": (1, 3, 4, 4)}, max_batch=4))
    graphs = int(version.split(".")[0]) >= 10
    # 8.5 never captures; on 8.6 a second context gets no profile: one context, no per-size graphs
    try:
        assert engine.max_batch == 4 and engine.describe()["max_batch"] == 4
        assert engine.inputs[0].shape == (None, 3, 4, 4) and engine.outputs[0].shape == (None, 3, 4, 4)
        x = np.arange(3 * 48, dtype=np.float32).reshape(3, 3, 4, 4)
        for batch in (x, x[:1], x):  # batch 3, then 1, then 3 again: each size keeps its own graph
            out = engine.infer({"x": batch})[0]
            assert out.shape == batch.shape
            np.testing.assert_array_equal(out, 2 * batch + 1)
        assert set(engine.graph_statuses) == {1, 3}
        assert all((s == "captured") == graphs for s in engine.graph_statuses.values()), engine.graph_statuses
        launches = cuda.launches
        np.testing.assert_array_equal(engine.infer({"x": x})[0], 2 * x + 1)
        assert cuda.launches == launches + int(graphs)  # the batch-3 graph replayed, not captured again
        with pytest.raises(EdgeError) as info:
            engine.infer({"x": np.zeros((5, 3, 4, 4), np.float32)})
        assert info.value.code == "BATCH_SIZE_UNSUPPORTED" and "1..4" in str(info.value)
    finally:
        engine.close()
    assert cuda.closed


def test_trt_context_refusing_a_batch_shape_is_a_batch_size_error(fake_backend, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The context refusing a batch's input shape (set_input_shape -> False) is BATCH_SIZE_UNSUPPORTED, as a
    size over max_batch is; a wrong frame shape at a size it takes stays INFERENCE_FAILED."""
    import tests.fake_nvidia as fake

    module = fake_backend(FakeCudaMemory())
    engine = module.TensorRTBackend().load(_plan(tmp_path),
                                           EngineOptions(static_shapes={"x": (1, 3, 4, 4)}, max_batch=4))
    real_set = fake._Context.set_input_shape
    monkeypatch.setattr(fake._Context, "set_input_shape",
                        lambda self, name, shape: shape[0] != 3 and real_set(self, name, shape))
    try:
        with pytest.raises(EdgeError) as info:
            engine.infer({"x": np.zeros((3, 3, 4, 4), np.float32)})
        assert info.value.code == "BATCH_SIZE_UNSUPPORTED" and "rejects a batch of 3" in str(info.value)
        with pytest.raises(EdgeError) as info:
            engine.infer({"x": np.zeros((2, 3, 5, 5), np.float32)})
        assert info.value.code == "INFERENCE_FAILED"
        x = np.ones((2, 3, 4, 4), np.float32)
        np.testing.assert_array_equal(engine.infer({"x": x})[0], 2 * x + 1)  # a size it takes still runs
    finally:
        engine.close()


def test_trt_max_batch_is_capped_by_the_profile_and_by_a_fixed_batch(fake_backend, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.fake_nvidia as fake

    module = fake_backend(FakeCudaMemory())
    engine = module.TensorRTBackend().load(_plan(tmp_path),
                                           EngineOptions(static_shapes={"x": (1, 3, 4, 4)}, max_batch=16))
    assert engine.max_batch == 4  # the fake plan's profile allows at most 4
    engine.close()
    plain = module.TensorRTBackend().load(_plan(tmp_path), EngineOptions(static_shapes={"x": (1, 3, 4, 4)}))
    assert plain.max_batch == 1 and plain.inputs[0].shape == (1, 3, 4, 4)  # batch-1 callers see what they saw
    plain.close()
    # A plan exported with batch 1: static I/O shapes, which the context reports without set_input_shape.
    monkeypatch.setattr(fake._Engine, "get_tensor_shape", lambda self, name: (1, 3, 4, 4))
    monkeypatch.setattr(fake._Context, "get_tensor_shape", lambda self, name: self._shapes.get(name, (1, 3, 4, 4)))
    fixed = module.TensorRTBackend(cuda_graphs=False).load(_plan(tmp_path), EngineOptions(max_batch=4))
    assert fixed.max_batch == 1 and fixed.inputs[0].shape == (1, 3, 4, 4)
    fixed.close()
