"""TensorRT contexts of issue 41, on the stand-ins (tests/fake_nvidia.py):

- optimization profiles of new contexts, per release (NvInferRuntime.h): 8.5 gives profile 0 implicitly only to
  the first context, 8.6 only while no other context holds it (a second one starts at -1, rejects every shape
  and enqueue, and cannot take profile 0), 10+ to every new context. A batched engine on 8.5/8.6 (JetPack 5/6.0,
  two cameras or more) must load and run every size: one context, shaped per batch, plain enqueue;
- one activation block per engine: every context is made without device memory of its own and given the
  engine's block (the fake refuses to enqueue a context that has none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.backends.base import EngineOptions
from tests.fake_nvidia import FakeCudaMemory, _Engine, api_versions, fake_tensorrt
from tests.test_backend_contract import _plan, fake_backend  # noqa: F401  (the TrtEngine-on-stand-ins fixture)

BATCHED = EngineOptions(static_shapes={"x": (1, 3, 4, 4)}, max_batch=4)
SEQUENCE = (1, 4, 2, 1, 3, 4, 2)  # the device check's batch-sequence, then sizes already seen
OLD = ["8.5.2", "8.6.1"]
NEW = [v for v in api_versions() if v not in OLD]
NOTHING_LIVE = {"buffers": 0, "pinned": 0, "streams": 0, "events": 0, "graphs": 0}


@pytest.fixture
def backend(fake_backend):  # noqa: F811 - the pytest fixture imported above, used by name
    return fake_backend


def _batch(n: int) -> np.ndarray:
    return np.arange(n * 48, dtype=np.float32).reshape(n, 3, 4, 4) - 7 * n


def _engine(version: str, cuda: FakeCudaMemory | None = None) -> Any:
    return fake_tensorrt(version, cuda=cuda or FakeCudaMemory()).Runtime(None).deserialize_cuda_engine(b"PLAN")


# --- the fake: what each release's header says a new context gets -----------------------------------------


@pytest.mark.parametrize("version", OLD)
def test_a_second_context_on_8x_has_no_profile_and_cannot_run(version: str) -> None:
    engine = _engine(version)
    first, second = engine.create_execution_context(), engine.create_execution_context()
    assert first.active_optimization_profile == 0 and second.active_optimization_profile == -1
    assert second.set_input_shape("x", (1, 3, 4, 4)) is False
    assert second.execute_async_v3(0) is False
    assert second.set_optimization_profile_async(0, 0) is False  # NVIDIA/TensorRT#846
    errors = engine._ctx.record["runtime_errors"]
    assert any("Profile 0 has been chosen by another IExecutionContext" in e for e in errors)


def test_on_86_a_new_context_gets_profile_0_once_its_holder_is_gone_and_on_85_only_the_first_does() -> None:
    for version, expected in (("8.6.1", 0), ("8.5.2", -1)):
        engine = _engine(version)
        first = engine.create_execution_context()
        del first  # released: on 8.6 no context holds profile 0 any more
        assert engine.create_execution_context().active_optimization_profile == expected, version


@pytest.mark.parametrize("version", NEW)
def test_from_10_every_new_context_gets_profile_0(version: str) -> None:
    engine = _engine(version)
    contexts = [engine.create_execution_context() for _ in range(3)]
    assert [c.active_optimization_profile for c in contexts] == [0, 0, 0]
    assert all(c.set_input_shape("x", (2, 3, 4, 4)) for c in contexts)


@pytest.mark.parametrize("version", api_versions())
def test_the_fake_refuses_to_enqueue_a_context_without_device_memory(version: str) -> None:
    cuda = FakeCudaMemory()
    trt = fake_tensorrt(version, cuda=cuda)
    engine = trt.Runtime(None).deserialize_cuda_engine(b"PLAN")
    strategies = getattr(trt, "ExecutionContextAllocationStrategy", None)
    if strategies is None:  # 8.x: createExecutionContext() takes no strategy
        with pytest.raises(TypeError):
            engine.create_execution_context(1)
        context = engine.create_execution_context_without_device_memory()
        size = engine.device_memory_size
    else:
        context = engine.create_execution_context(strategies.USER_MANAGED)
        size = engine.device_memory_size_v2
    x, y = cuda.malloc(48 * 4), cuda.malloc(48 * 4)
    assert context.set_input_shape("x", (1, 3, 4, 4))
    context.set_tensor_address("x", x.ptr)
    context.set_tensor_address("y", y.ptr)
    assert context.execute_async_v3(0) is False  # no activation memory yet
    block = cuda.malloc(size)
    if hasattr(context, "set_device_memory"):  # 10.1+
        context.set_device_memory(block.ptr, size - 1)
        assert context.execute_async_v3(0) is False  # too small a block is refused
        context.set_device_memory(block.ptr, size)
    else:
        assert not hasattr(context, "device_memory")  # write-only, as pybind11 binds it on 8.x
        context.device_memory = block.ptr
    assert context.execute_async_v3(0) is True
    assert trt._record.get("static_context_bytes", []) == []  # TensorRT allocated no activations itself
    engine.create_execution_context()
    assert trt._record["static_context_bytes"] == [size]  # a default (STATIC) context does


# --- the engine: every batch size runs on every release ---------------------------------------------------


@pytest.mark.parametrize("version", OLD)
def test_a_batched_engine_on_8x_loads_and_runs_every_size_with_one_context(backend, tmp_path: Path,
                                                                           version: str) -> None:
    """Fails before issue 41 on 8.6: the batch-1 context got profile -1, so the load itself raised
    `BatchSizeError: e.plan: input x rejects a batch of 1`."""
    cuda = FakeCudaMemory()
    engine = backend(cuda, version).TensorRTBackend().load(_plan(tmp_path), BATCHED)
    try:
        for n in SEQUENCE:
            np.testing.assert_array_equal(engine.infer({"x": _batch(n)})[0], 2 * _batch(n) + 1, err_msg=f"batch {n}")
        info = engine.describe()
        assert info["context_scheme"] == "single" and info["contexts_sharing_activation"] == 1
        assert set(engine.graph_statuses) == {1, 2, 3, 4} and cuda.launches == 0 and cuda.stale_replays == 0
        if version == "8.6.1":  # 8.5 never captures (graph_capture_blocker); 8.6 is switched by what it saw
            assert "no optimization profile" in info["context_scheme_reason"]
            assert all(s.startswith("not captured") and "optimization profile" in s
                       for s in engine.graph_statuses.values())
    finally:
        engine.close()
    assert cuda.live() == NOTHING_LIVE


@pytest.mark.parametrize("version", NEW)
def test_from_10_a_batched_engine_keeps_a_context_per_size(backend, tmp_path: Path, version: str) -> None:
    cuda = FakeCudaMemory()
    engine = backend(cuda, version).TensorRTBackend().load(_plan(tmp_path), BATCHED)
    try:
        for n in SEQUENCE:
            np.testing.assert_array_equal(engine.infer({"x": _batch(n)})[0], 2 * _batch(n) + 1)
        info = engine.describe()
        assert info["context_scheme"] == "per-size" and info["contexts"] == [1, 2, 3, 4]
        assert engine.graph_statuses == {n: "captured" for n in (1, 2, 3, 4)}
    finally:
        engine.close()


@pytest.mark.parametrize("version", ["8.6.1", "10.3.0"])
def test_the_build_report_says_which_context_scheme_the_batch_curve_ran(backend, tmp_path: Path,
                                                                        version: str) -> None:
    from engines.build import batch_size
    from engines.build.job import BuildJob
    from engines.build.spec import EngineBuildSpec

    backend(FakeCudaMemory(), version)
    spec = EngineBuildSpec(precision="fp16", input_shapes={"x": (1, 3, 4, 4)}, max_batch=4)
    job = BuildJob("tensorrt", tmp_path / "m.onnx", _plan(tmp_path), tmp_path / "work", spec, {})
    report: dict[str, Any] = {"notes": []}
    batch_size.time_build(job, report, lambda *a, **k: None, warmup=0, min_rounds=1, max_rounds=1)
    contexts = report["batch"]["contexts"]
    assert set(report["batch"]["curve"]) == {"1", "2", "3", "4"}
    assert contexts["scheme"] == ("single" if version == "8.6.1" else "per-size")
    assert ("optimization profile" in contexts["reason"]) == (version == "8.6.1")


# --- one activation block per engine ----------------------------------------------------------------------


@pytest.mark.parametrize("version", api_versions())
def test_every_context_shares_the_engines_one_activation_block(backend, tmp_path: Path, version: str) -> None:
    """Fails before issue 41: every per-size context was a default (STATIC) one, each with its own activations."""
    cuda = FakeCudaMemory()
    module = backend(cuda, version)
    engine = module.TensorRTBackend().load(_plan(tmp_path), BATCHED)
    trt = module.trt
    try:
        for n in SEQUENCE:
            engine.infer({"x": _batch(n)})
        info = engine.describe()
        assert trt._record.get("static_context_bytes", []) == []  # no context allocated activations of its own
        assert info["activation_bytes"] == _Engine._activation_bytes
        assert info["contexts_sharing_activation"] == (4 if info["context_scheme"] == "per-size" else 1)
        assert cuda.live()["buffers"] == 3  # x, y and the one activation block
    finally:
        engine.close()
    assert cuda.live() == NOTHING_LIVE
