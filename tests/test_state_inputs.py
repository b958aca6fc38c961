"""State inputs (manifest `state`): recurrent state fed back from outputs per camera, and constants.

No public package ships Robust Video Matting (or any recurrent matting model) as a file we can fetch, so the
model here is an onnx.helper graph with RVM's exact interface: inputs `src` (1x3xHxW, RGB 0..1), `r1i`..`r4i`
(dims named as RVM's export names them: batch_size, channels, height, width) and `downsample_ratio` ([1]);
outputs `fgr`, `pha`, `r1o`..`r4o`. Its outputs encode how many frames fed it: `rKo = rKi + 1` broadcast to
RVM's state size (H/2^K x W/2^K), so a [1, 1, 1, 1] zero state at a stream's first frame comes back full size
reading 1, and after k frames on one stream the state reads k; `pha = mean(r1o) * downsample_ratio * 0.04`
everywhere (0.01 k with the ratio 0.25), so the matte shows the count and proves the constant is fed.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.errors import ModelError
from engines.manifest import PostprocessSpec, StateSpec, parse_manifest
from engines.state_inputs import model_input_dims
from engines.model import load_bare_onnx
from engines.preprocess import PreprocessSpec
from engines.runtime import load_runtime

WIDTH, HEIGHT = 64, 48  # divisible by 16: RVM's r4 state is 1/16 of the frame
STATE = {"pairs": [{"input": f"r{k}i", "output": f"r{k}o"} for k in range(1, 5)],
         "constants": {"downsample_ratio": 0.25}}
PREPROCESS = PreprocessSpec(width=WIDTH, height=HEIGHT, color="rgb")
MATTE = PostprocessSpec(kind="image", params={"output": 1})  # pha


def rvm_like(path: Path, r4o_dtype: int = TensorProto.FLOAT) -> Path:
    """RVM's interface; the states count the frames of their stream (module docstring)."""
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("zero", 0.0), ("one", 1.0),
                                                                             ("gain", 0.04))]
    nodes, previous = [], "src"
    for k in range(1, 5):  # pooled k times: the state's size at level k, zeroed, plus (rKi + 1)
        nodes += [helper.make_node("AveragePool", [previous], [f"p{k}"], kernel_shape=[2, 2], strides=[2, 2]),
                  helper.make_node("ReduceMean", [f"p{k}"], [f"g{k}"], axes=[1], keepdims=1),
                  helper.make_node("Mul", [f"g{k}", "zero"], [f"z{k}"]),
                  helper.make_node("Add", [f"r{k}i", "one"], [f"n{k}"]),
                  helper.make_node("Add", [f"z{k}", f"n{k}"], [f"r{k}o" if k < 4 or r4o_dtype == TensorProto.FLOAT
                                                              else "r4f"])]
        previous = f"p{k}"
    if r4o_dtype != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", ["r4f"], ["r4o"], to=r4o_dtype))
    nodes += [helper.make_node("ReduceMean", ["r1o"], ["count"], keepdims=1),
              helper.make_node("Mul", ["count", "downsample_ratio"], ["scaled"]),
              helper.make_node("Mul", ["scaled", "gain"], ["level"]),
              helper.make_node("ReduceMean", ["src"], ["gray"], axes=[1], keepdims=1),
              helper.make_node("Mul", ["gray", "zero"], ["blank"]),
              helper.make_node("Add", ["blank", "level"], ["pha"]),
              helper.make_node("Identity", ["src"], ["fgr"])]
    # r1i is named as RVM's export names it (batch_size, channels, height, width: the frame's "height" on another
    # size, which must not be pinned to the frame's); the others by level, so ORT plans their buffers apart
    dims = {k: ["batch_size", "channels", *(("height", "width") if k == 1 else (f"h{k}", f"w{k}"))]
            for k in range(1, 5)}
    inputs = [helper.make_tensor_value_info("src", TensorProto.FLOAT, ["batch_size", 3, "height", "width"]),
              *(helper.make_tensor_value_info(f"r{k}i", TensorProto.FLOAT, dims[k]) for k in range(1, 5)),
              helper.make_tensor_value_info("downsample_ratio", TensorProto.FLOAT, [1])]
    outputs = [helper.make_tensor_value_info("fgr", TensorProto.FLOAT, ["batch_size", 3, "height", "width"]),
               helper.make_tensor_value_info("pha", TensorProto.FLOAT, ["batch_size", 1, "height", "width"]),
               *(helper.make_tensor_value_info(f"r{k}o", TensorProto.FLOAT if k < 4 else r4o_dtype,
                                               [None] * 4) for k in range(1, 5))]
    graph = helper.make_graph(nodes, "rvm-like", inputs, outputs, consts)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


@pytest.fixture
def rvm(tmp_path: Path) -> Path:
    return rvm_like(tmp_path / "rvm.onnx")


def runtime_of(model: Path, state: dict[str, Any] | None = STATE) -> Any:
    fields: dict[str, Any] = {"preprocess": PREPROCESS, "postprocess": MATTE}
    if state is not None:
        fields["state"] = StateSpec.model_validate(state)
    return load_runtime(load_bare_onnx(model, fields), "onnxruntime")


def frame(seed: int, size: tuple[int, int] = (120, 160)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)


def count_of(runtime: Any, stream: str) -> set[float]:
    """The frames the stream's state has counted, read from every state tensor (one value each)."""
    state = runtime.states.state_of(stream)
    return {float(v) for tensor in state.values() for v in np.unique(tensor)}


def test_state_is_fed_back_per_stream_and_starts_again_on_reset_and_size_change(rvm: Path) -> None:
    runtime = runtime_of(rvm)
    try:
        assert runtime.input_name == "src" and runtime.max_batch == 1
        assert runtime.states.state_of("a") is None
        results = [runtime.run(frame(i), "a")[0] for i in range(3)]
        assert count_of(runtime, "a") == {3.0}
        shapes = {name: t.shape for name, t in runtime.states.state_of("a").items()}
        assert shapes == {"r1i": (1, 1, 24, 32), "r2i": (1, 1, 12, 16), "r3i": (1, 1, 6, 8), "r4i": (1, 1, 3, 4)}
        # the matte is 0.01 k (ratio 0.25 fed as the constant): frame k of the stream reads k
        assert [int(r.matte.max()) for r in results] == [int(0.01 * k * 255) for k in (1, 2, 3)]
        assert all(r.matte.min() == r.matte.max() for r in results)

        runtime.run(frame(7), "b")  # another camera counts its own frames
        assert count_of(runtime, "b") == {1.0} and count_of(runtime, "a") == {3.0}
        runtime.run(frame(8), "a")
        assert count_of(runtime, "a") == {4.0}

        runtime.reset_state("a")  # a camera restart
        assert runtime.states.state_of("a") is None and count_of(runtime, "b") == {1.0}
        runtime.run(frame(9), "a")
        assert count_of(runtime, "a") == {1.0}

        runtime.run(frame(10), "b")
        assert count_of(runtime, "b") == {2.0}
        runtime.run(frame(11, (240, 320)), "b")  # the camera's frame size changed: its state describes another picture
        assert count_of(runtime, "b") == {1.0}
        runtime.run(frame(12, (240, 320)), "b")
        assert count_of(runtime, "b") == {2.0}
    finally:
        runtime.close()


def test_a_new_runtime_starts_empty_and_the_constant_is_fed(rvm: Path) -> None:
    first = runtime_of(rvm)
    try:
        for i in range(3):
            first.run(frame(i), "a")
    finally:
        first.close()
    swapped = runtime_of(rvm, {**STATE, "constants": {"downsample_ratio": 0.5}})  # a model swap: a new runtime
    try:
        assert swapped.states.state_of("a") is None
        result, _ = swapped.run(frame(3), "a")
        assert count_of(swapped, "a") == {1.0}
        assert int(result.matte.max()) == int(0.02 * 255)  # ratio 0.5: twice the 0.25 matte of a first frame
    finally:
        swapped.close()


def test_warmup_leaves_no_state_behind(rvm: Path) -> None:
    runtime = runtime_of(rvm)
    try:
        runtime.warmup(frame(0), runs=2)
        assert runtime.states.state_of("default") is None
    finally:
        runtime.close()


def test_a_stateful_model_takes_one_frame_per_call(rvm: Path) -> None:
    from agent.pipeline.batch_runtime import BatchRuntime, engine_capacity
    from agent.pipeline.batch_size import resolve_batch_size
    from engines.batching import STATE_BATCH_REASON
    from engines.errors import BatchSizeError

    runtime = runtime_of(rvm)
    try:
        with pytest.raises(BatchSizeError) as info:
            runtime.infer_batch(np.zeros((2, 3, HEIGHT, WIDTH), np.float32))
        assert "state inputs" in str(info.value)
        batch = BatchRuntime(runtime, 2)
        assert engine_capacity(runtime) == 1 and not batch.batched
        try:
            for i in range(3):  # camera a in every batch, b in the first only
                batch.run([frame(i), frame(10 + i)] if i == 0 else [frame(i)], ["a", "b"] if i == 0 else ["a"])
        finally:
            batch.close()
        assert count_of(runtime, "a") == {3.0} and count_of(runtime, "b") == {1.0}
    finally:
        runtime.close()
    size = resolve_batch_size(4, 4, {"1": 10.0, "4": 5.0}, None, stateful=True)
    assert (size.size, size.reason) == (1, STATE_BATCH_REASON)


def test_the_build_plan_of_a_stateful_model_is_batch_1(rvm: Path) -> None:
    from engines.build.provisioning import plan_build

    source = load_bare_onnx(rvm, {"preprocess": PREPROCESS, "postprocess": MATTE, "state": STATE})
    spec = plan_build(source, "onnxruntime", max_batch=4).spec
    assert spec.max_batch == 1 and spec.input_shapes == {"src": (1, 3, HEIGHT, WIDTH)}
    bare = load_bare_onnx(rvm, {"preprocess": PREPROCESS, "postprocess": MATTE})
    with pytest.raises(ModelError) as info:  # undeclared, the extra inputs are refused at plan time too
        plan_build(bare, "onnxruntime", max_batch=4)
    assert info.value.code == "MODEL_SHAPE_MISMATCH" and "`state`" in str(info.value)


def test_validation_runs_the_frames_in_sequence_on_one_stream(rvm: Path) -> None:
    from engines.manifest import Gates
    from engines.build.validate import VALIDATION_STREAM, _sequence, validate

    reference, candidate = runtime_of(rvm), runtime_of(rvm)
    try:
        frames = [frame(i) for i in range(4)]
        pairs = _sequence(reference, candidate, frames)
        r1o = [o.name for o in candidate.engine.outputs].index("r1o")
        for k, (ref, cand) in enumerate(pairs, start=1):  # each frame fed the state the one before left
            assert float(ref[0][r1o].mean()) == float(cand[0][r1o].mean()) == k
        result = validate(candidate, reference, frames, precision="fp32", gates=Gates(), latency_runs=2, warmup=1)
        assert result.passed, result.reason
        assert result.accuracy == pytest.approx(1.0)
        assert candidate.states.state_of(VALIDATION_STREAM) is None  # the gate's frames are no camera's history
        again = _sequence(reference, candidate, frames)  # a second judgement starts from zeros again
        assert float(again[0][0][0][r1o].mean()) == 1.0
    finally:
        reference.close()
        candidate.close()


# --- the manifest's `state` against the model ---------------------------------------------------------


def _refusal(model: Path, state: dict[str, Any] | None) -> ModelError:
    with pytest.raises(ModelError) as info:
        model_input_dims(model, StateSpec.model_validate(state) if state is not None else None)
    return info.value


def test_without_a_state_section_the_extra_inputs_are_refused_with_how_to_declare_them(rvm: Path) -> None:
    error = _refusal(rvm, None)
    assert error.code == "MODEL_SHAPE_MISMATCH"
    assert "frame models need exactly one input" in str(error) and "r1i" in str(error)
    assert "`state`" in str(error) and "pairs" in str(error) and "constants" in str(error)
    with pytest.raises(ModelError) as info:  # the runtime says the same
        runtime_of(rvm, None)
    assert info.value.code == "MODEL_SHAPE_MISMATCH" and "`state`" in str(info.value)


@pytest.mark.parametrize("state, code, words", [
    ({**STATE, "pairs": [*STATE["pairs"][:3], {"input": "r9i", "output": "r4o"}]}, "MODEL_STATE_MISMATCH",
     ["no input 'r9i'", "r4i"]),
    ({**STATE, "pairs": [*STATE["pairs"][:3], {"input": "r4i", "output": "r4x"}]}, "MODEL_STATE_MISMATCH",
     ["r4i", "'r4x'", "does not output", "r4o"]),
    ({**STATE, "pairs": STATE["pairs"][:3]}, "MODEL_SHAPE_MISMATCH", ["exactly one input", "['src', 'r4i'] not fed"]),
    ({"pairs": STATE["pairs"]}, "MODEL_SHAPE_MISMATCH", ["downsample_ratio", "not fed", "constants"]),
    ({**STATE, "pairs": [*STATE["pairs"][:3], {"input": "r4i", "output": "r4o", "init_shape": [1, 1, 1]}]},
     "MODEL_STATE_MISMATCH", ["r4i", "init_shape [1, 1, 1]", "does not fit"]),
    ({**STATE, "constants": {"downsample_ratio": [0.25, 0.5]}}, "MODEL_STATE_MISMATCH",
     ["downsample_ratio", "2 values", "[1]"]),
    ({**STATE, "constants": {"downsample_ratio": 0.25, "src": 1.0}}, "MODEL_STATE_MISMATCH",
     ["feeds every input"]),
], ids=["unknown-input", "unknown-output", "unfed-state", "unfed-constant", "init-rank", "constant-size",
        "frame-declared"])
def test_a_state_section_that_does_not_fit_the_model_is_refused(rvm: Path, state: dict, code: str,
                                                                 words: list[str]) -> None:
    error = _refusal(rvm, state)
    assert error.code == code, error
    for word in words:
        assert word in str(error), (word, str(error))


def test_a_state_fed_back_in_another_dtype_is_refused(tmp_path: Path) -> None:
    model = rvm_like(tmp_path / "half.onnx", r4o_dtype=TensorProto.FLOAT16)
    error = _refusal(model, STATE)
    assert error.code == "MODEL_STATE_MISMATCH"
    assert "r4o is float16" in str(error) and "r4i takes float32" in str(error)


def test_the_state_section_is_given_with_a_valid_one(rvm: Path) -> None:
    name, dims = model_input_dims(rvm, StateSpec.model_validate(STATE))
    assert (name, dims) == ("src", [None, 3, None, None])
    with_init = {**STATE, "pairs": [{"input": "r1i", "output": "r1o", "init_shape": [1, 1, 24, 32]},
                                    *STATE["pairs"][1:]]}
    runtime = runtime_of(rvm, with_init)
    try:
        runtime.run(frame(0), "a")
        assert count_of(runtime, "a") == {1.0}
    finally:
        runtime.close()


@pytest.mark.parametrize("state, words", [
    ({"pairs": [{"input": "r1i", "output": "r1o"}, {"input": "r1i", "output": "r2o"}]},
     ["input ['r1i']", "more than once"]),
    ({"pairs": [{"input": "r1i", "output": "r1o"}], "constants": {"r1i": 0.0}}, ["['r1i']", "not both"]),
    ({}, ["no pair and no constant"]),
    ({"pairs": [{"input": "r1i", "output": "r1o", "init_shape": [1, 0]}]}, ["init_shape", ">= 1"]),
    ({"pairs": [{"input": "r1i", "output": "r1o", "initial": 0}]}, ["initial", "Extra inputs"]),
], ids=["input-twice", "pair-and-constant", "empty", "zero-dim", "unknown-field"])
def test_a_malformed_state_section_is_a_manifest_error(state: dict, words: list[str]) -> None:
    raw = {"name": "rvm", "version": "1", "model": {"file": "rvm.onnx", "sha256": "0" * 64, "size": 1}, "state": state}
    with pytest.raises(ModelError) as info:
        parse_manifest(json.dumps(raw).encode())
    assert info.value.code == "MANIFEST_INVALID"
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_int8_is_refused_for_a_stateful_model() -> None:

    raw = {"name": "rvm", "version": "1", "model": {"file": "rvm.onnx", "sha256": "0" * 64, "size": 1},
           "state": STATE, "build": {"precision": "int8"}}
    with pytest.raises(ModelError) as info:
        parse_manifest(json.dumps(raw).encode())
    assert info.value.code == "MANIFEST_INVALID" and "int8" in str(info.value) and "state" in str(info.value)


# --- TensorRT: refused, with the fake TensorRT of tests/fake_nvidia.py ------------------------------------


def test_tensorrt_refuses_a_stateful_model_before_building(rvm: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.build import tensorrt as tb
    from engines.build.job import BuildJob
    from engines.build.spec import EngineBuildError, EngineBuildSpec
    from tests.fake_nvidia import fake_tensorrt

    trt = fake_tensorrt("10.3.0")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    spec = EngineBuildSpec(precision="fp16", input_shapes={"src": (1, 3, HEIGHT, WIDTH)})
    job = BuildJob("tensorrt", rvm, tmp_path / "out.plan", tmp_path / "work", spec, PREPROCESS.model_dump())
    with pytest.raises(EngineBuildError) as info:
        tb.build_plan(job, lambda *a, **k: None)
    assert info.value.code == "ENGINE_STATE_UNSUPPORTED"
    assert "r1i" in str(info.value) and 'backend = "onnxruntime"' in str(info.value)
    assert trt._record["profiles"] == [] and not job.out_path.exists()  # nothing parsed, nothing built


# --- through the real agent: two synthetic cameras ------------------------------------------------------


def _steps(counts: list[tuple[str, int]], camera: str) -> list[int]:
    seen = [count for name, count in counts if name == camera]
    return [b - a for a, b in zip(seen, seen[1:])]


@pytest.mark.slow
def test_the_agent_carries_each_cameras_own_state(tmp_path: Path) -> None:
    """Two synthetic cameras into one stateful model through the real agent (build, gates, frame path): each
    camera's mattes count that camera's frames alone (a shared state would step by 2), the batch decision says
    why it is 1, and restarting one camera starts its count again while the other's runs on."""
    from agent.artifacts.builder import build_artifact
    from agent.artifacts.keys import load_private_key
    from agent.config import AgentConfig
    from agent.daemon.runner import Agent
    from engines.batching import STATE_BATCH_REASON
    from engines.manifest import Gates, Manifest, ModelFile
    from tests.deploy_fixtures import agent_settings, make_key
    from tests.helpers import wait_for

    private, public = make_key(tmp_path / "keys")
    template = Manifest(name="rvm-like", version="1.0.0", model=ModelFile(file="rvm.onnx", sha256="0" * 64, size=0),
                        preprocess=PREPROCESS, postprocess=MATTE, state=StateSpec.model_validate(STATE),
                        gates=Gates(latency_budget_ms=5000.0, synthetic_frames=True))
    artifact = tmp_path / "artifact"
    build_artifact(artifact, template, {"rvm.onnx": rvm_like(tmp_path / "rvm.onnx")}, load_private_key(private),
                   replace=True)
    settings = agent_settings(tmp_path, public, artifact, batch={"max_size": 2, "timeout_ms": 50})
    settings.pop("camera")
    settings["cameras"] = [{"name": name, "kind": "synthetic", "width": 160, "height": 120, "fps": 10, "seed": seed}
                           for name, seed in (("a", 1), ("b", 2))]
    counts: list[tuple[str, int]] = []  # (camera, the frame count its matte shows)
    agent = Agent(AgentConfig(**settings), on_event=lambda *a, **k: None)
    agent.start()
    try:
        original = agent.worker.on_result

        def collect(frame: Any, result: Any, runtime: Any) -> None:
            counts.append((frame.source, round(float(result.matte.max()) / 2.55)))
            original(frame, result, runtime)

        agent.worker.on_result = collect
        assert (agent.batch_size.size, agent.batch_size.reason) == (1, STATE_BATCH_REASON)
        assert wait_for(lambda: all(len(_steps(counts, c)) >= 4 for c in "ab"), timeout=120)
        assert all(set(_steps(counts, c)) == {1} for c in "ab"), counts

        mark = len(counts)
        assert agent.restart_capture("a")["restarted"]
        assert wait_for(lambda: sum(1 for c, _ in counts[mark:] if c == "a") >= 3 and
                        sum(1 for c, _ in counts[mark:] if c == "b") >= 3, timeout=120)
        after = counts[mark:]
        before_a = max(n for c, n in counts[:mark] if c == "a")
        assert min(n for c, n in after if c == "a") <= 2 < before_a, counts  # camera a counts from the start again
        assert set(_steps(counts, "b")) == {1}, counts  # camera b never noticed
    finally:
        agent.stop()
    assert agent.stats.errors == 0


# --- review fixes: swaps, variants, shadow, build verify, backend and precision plans, constants, package --------


def test_a_runtime_swapped_back_in_starts_its_cameras_from_zeros(rvm: Path) -> None:
    """A rollback to `previous` or an adaptive switch installs the SAME runtime again: the state its cameras
    left when it was swapped out must not feed their next frames."""
    from agent.pipeline.frame_stats import FrameStats
    from agent.pipeline.mailbox import FreshestMailbox
    from agent.pipeline.worker import InferenceWorker

    first, other = runtime_of(rvm), runtime_of(rvm)
    stop = threading.Event()
    worker = InferenceWorker(first, FreshestMailbox(), stop, FrameStats(), overlap_postprocess=False)
    try:
        worker.batch.run([frame(0)], ["a"])
        worker.batch.run([frame(1)], ["a"])
        assert count_of(first, "a") == {2.0}
        assert worker.swap(other) is first  # the worker is not running: installed at once, as at a batch boundary
        worker.batch.run([frame(2)], ["a"])
        assert worker.swap(first) is other and worker.runtime is first
        assert first.states.state_of("a") is None
        worker.batch.run([frame(3)], ["a"])
        assert count_of(first, "a") == {1.0}  # counted from the start again, not 3
    finally:
        worker.batch.close()
        first.close()
        other.close()



def test_a_frame_captured_before_its_camera_restarted_seeds_no_state(rvm: Path) -> None:
    """A camera restart resets its state, but the frame waiting in its mailbox was captured before: it runs on
    zeros and its state is not kept, so the restarted capture's first frame starts from zeros (before, it
    followed the old frame's state). Through the frame path's BatchRuntime, as the worker calls it."""
    import time

    from agent.pipeline.batch_runtime import BatchRuntime

    runtime = runtime_of(rvm)
    batch = BatchRuntime(runtime, 1)
    try:
        for i in range(3):
            batch.run([frame(i)], ["a"], [time.monotonic()])
        batch.run([frame(9)], ["b"], [time.monotonic()])
        waiting = time.monotonic()  # captured, then the camera restarts before the frame is inferred
        runtime.reset_state("a")
        old = batch.run([frame(3)], ["a"], [waiting])[0].result
        assert int(old.matte.max()) == int(0.01 * 1 * 255)  # ran on zeros: it counts as a first frame
        assert runtime.states.state_of("a") is None  # and left no state behind
        assert count_of(runtime, "b") == {1.0}  # the other camera keeps its own
        batch.run([frame(4)], ["a"], [time.monotonic()])
        assert count_of(runtime, "a") == {1.0}
        batch.run([frame(5)], ["a"], [time.monotonic()])
        assert count_of(runtime, "a") == {2.0}
        runtime.reset_state()  # every stream (a swap): the captures go on unbroken, the waiting frame starts it
        batch.run([frame(6)], ["b"], [waiting])
        assert count_of(runtime, "b") == {1.0}
        batch.run([frame(7)], ["a"], [waiting])  # but camera a's own cut still holds
        assert runtime.states.state_of("a") is None
    finally:
        batch.close()
        runtime.close()


def test_a_camera_restart_resets_the_serving_model_and_one_about_to_be_swapped_in(rvm: Path) -> None:
    """CameraGroup's restart callback goes to the worker, which resets both under its swap lock: a swap in the
    same instant cannot carry the reset away with the model it replaces."""
    from agent.pipeline.batch_runtime import BatchRuntime
    from agent.pipeline.frame_stats import FrameStats
    from agent.pipeline.mailbox import FreshestMailbox
    from agent.pipeline.worker import InferenceWorker

    serving, incoming = runtime_of(rvm), runtime_of(rvm)
    worker = InferenceWorker(serving, FreshestMailbox(), threading.Event(), FrameStats(), overlap_postprocess=False)
    pending = BatchRuntime(incoming, 1)
    try:
        worker.batch.run([frame(0)], ["a"])
        pending.run([frame(1)], ["a"])
        worker._pending = pending  # what swap() leaves for the loop's next batch boundary
        worker.reset_state("a")
        assert serving.states.state_of("a") is None and incoming.states.state_of("a") is None
    finally:
        worker._pending = None
        pending.close()
        worker.batch.close()
        serving.close()
        incoming.close()

def test_variants_are_refused_with_state() -> None:
    raw = {"name": "rvm", "version": "1", "model": {"file": "rvm.onnx", "sha256": "0" * 64, "size": 1},
           "files": [{"file": "small.onnx", "sha256": "0" * 64, "size": 1}], "state": STATE,
           "variants": [{"name": "small", "file": "small.onnx", "precision": "fp16"}]}
    with pytest.raises(ModelError) as info:
        parse_manifest(json.dumps(raw).encode())
    assert info.value.code == "MANIFEST_INVALID" and "variants" in str(info.value) and "state" in str(info.value)
    raw.pop("state")
    assert parse_manifest(json.dumps(raw).encode()).variants  # the same family without state is fine


def test_a_stateful_candidate_is_refused_as_a_shadow(rvm: Path) -> None:
    from types import SimpleNamespace

    from agent.daemon.shadow_host import ShadowHost
    from engines.errors import EdgeError

    serving = load_bare_onnx(rvm, {"preprocess": PREPROCESS, "postprocess": MATTE, "state": STATE})
    slots = SimpleNamespace(active=SimpleNamespace(source=serving))
    host = ShadowHost(slots, loader=None, config=None, throttled=lambda: False, adapt_over_limit=lambda: False)
    with pytest.raises(EdgeError) as info:
        host.check_comparable(serving)  # same kind as the serving model: refused for its state alone
    assert info.value.code == "SHADOW_INCOMPARABLE"
    assert "every frame of its camera in order" in str(info.value)
    plain = serving.manifest.model_copy(update={"state": None})
    host.check_comparable(SimpleNamespace(manifest=plain, label="plain"))  # the same without state shadows


def frame_sized_state(path: Path) -> Path:
    """A state that must have the frame's height and width: `mix = Concat(src, r)` on the channels, `ro` its mean
    over them; so a [1, 1, 1, 1] state (what ones "1 where dynamic" would feed) cannot run, [1, 1, H, W] can."""
    nodes = [helper.make_node("Concat", ["src", "r"], ["mix"], axis=1),
             helper.make_node("ReduceMean", ["mix"], ["ro"], axes=[1], keepdims=1)]
    graph = helper.make_graph(
        nodes, "frame-sized-state",
        [helper.make_tensor_value_info("src", TensorProto.FLOAT, [1, 3, "height", "width"]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 1, "rh", "rw"])],
        [helper.make_tensor_value_info("mix", TensorProto.FLOAT, [1, 4, None, None]),
         helper.make_tensor_value_info("ro", TensorProto.FLOAT, [1, 1, None, None])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def test_the_build_verify_step_feeds_the_first_frames_state(tmp_path: Path) -> None:
    from engines.build.job import BuildJob
    from engines.build.worker import build_onnxruntime
    from engines.build.provisioning import _state_dump, plan_build

    state = {"pairs": [{"input": "r", "output": "ro", "init_shape": [1, 1, HEIGHT, WIDTH]}]}
    source = load_bare_onnx(frame_sized_state(tmp_path / "fs.onnx"),
                            {"preprocess": PREPROCESS, "postprocess": {"kind": "raw"}, "state": state})
    plan = plan_build(source, "onnxruntime", fingerprint_root=tmp_path)
    job = BuildJob("onnxruntime", source.onnx_path, tmp_path / "work" / "engine.onnx", tmp_path / "work", plan.spec,
                   PREPROCESS.model_dump(mode="json"), source.label, state=_state_dump(source))
    job.work_dir.mkdir()
    job = BuildJob.from_json(job.to_json())  # as the build child reads it
    assert job.state == source.manifest.state.model_dump(mode="json")
    build_onnxruntime(job, lambda *a, **k: None)
    assert job.out_path.exists()
    runtime = load_runtime(load_bare_onnx(job.out_path, {"preprocess": PREPROCESS, "postprocess": {"kind": "raw"},
                                                         "state": state}), "onnxruntime")
    try:
        runtime.run(frame(0), "a")
        assert runtime.states.state_of("a")["r"].shape == (1, 1, HEIGHT, WIDTH)
    finally:
        runtime.close()


def test_auto_plans_a_stateful_model_on_onnxruntime_and_explicit_tensorrt_is_refused(
        rvm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import engines.build.provisioning as provision
    from engines.build.spec import EngineBuildError

    source = load_bare_onnx(rvm, {"preprocess": PREPROCESS, "postprocess": MATTE, "state": STATE})
    with pytest.raises(EngineBuildError) as info:
        provision.plan_build(source, "tensorrt", fingerprint_root=tmp_path)
    assert info.value.code == "ENGINE_STATE_UNSUPPORTED" and "onnxruntime" in str(info.value)
    # a device where auto picks TensorRT (its readiness checks pass)
    monkeypatch.setattr(provision, "resolve_backend", lambda name: "tensorrt" if name == "auto" else name)
    plan = provision.plan_build(source, "auto", fingerprint_root=tmp_path)
    assert plan.backend == "onnxruntime" and "state inputs" in plan.backend_reason
    assert plan.spec.providers and not plan.spec.profiles  # an ONNX Runtime spec, not a TensorRT one


def test_a_precision_override_to_int8_is_refused_for_a_stateful_model(rvm: Path, tmp_path: Path) -> None:
    from engines.build.spec import EngineBuildError
    from engines.build.provisioning import plan_build

    source = load_bare_onnx(rvm, {"preprocess": PREPROCESS, "postprocess": MATTE, "state": STATE})
    assert plan_build(source, "onnxruntime", precision="fp32", fingerprint_root=tmp_path).precision == "fp32"
    with pytest.raises(EngineBuildError) as info:  # `edge-agent engines build --precision int8`
        plan_build(source, "onnxruntime", precision="int8", fingerprint_root=tmp_path)
    assert info.value.code == "ENGINE_PRECISION_UNSUPPORTED" and "int8" in str(info.value)


@pytest.mark.parametrize("value, words", [
    (True, ["downsample_ratio", "valid number"]), ([], ["downsample_ratio", "at least 1"]),
    ("0.25", ["downsample_ratio", "valid number"]), ([0.25, False], ["downsample_ratio", "valid number"]),
], ids=["bool", "empty-list", "string", "bool-in-list"])
def test_a_constant_that_is_no_number_is_a_manifest_error(value: Any, words: list[str]) -> None:
    raw = {"name": "rvm", "version": "1", "model": {"file": "rvm.onnx", "sha256": "0" * 64, "size": 1},
           "state": {**STATE, "constants": {"downsample_ratio": value}}}
    with pytest.raises(ModelError) as info:
        parse_manifest(json.dumps(raw).encode())
    assert info.value.code == "MANIFEST_INVALID"
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("dtype, value, words", [
    ("uint8", -1.0, ["-1.0", "out of uint8's range"]), ("uint8", 256.0, ["256.0", "uint8"]),
    ("int8", 2.5, ["2.5", "not a whole number", "int8"]), ("float16", 1e300, ["1e+300", "float16"]),
    ("float32", float("inf"), ["inf", "not a finite number"]), ("float32", True, ["True", "not a finite number"]),
], ids=["uint8-negative", "uint8-over", "int-fraction", "float16-overflow", "inf", "bool"])
def test_a_constant_out_of_its_inputs_range_is_refused(dtype: str, value: Any, words: list[str]) -> None:
    from engines.backends.base import TensorSpec
    from engines.state_inputs import constant_array

    spec = TensorSpec("k", (1,), dtype)
    with pytest.raises(ModelError) as info:
        constant_array(value, spec, "m.onnx")
    assert info.value.code == "MODEL_STATE_MISMATCH" and "constant k" in str(info.value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert constant_array(255.0 if dtype == "uint8" else 1.0, spec, "m.onnx").dtype == np.dtype(dtype)


def test_a_plain_models_batches_build_no_stream_list(tmp_path: Path) -> None:
    """The frame path of a model without state calls the engine as before: no per-slot (camera, shape, time)
    list."""
    from agent.pipeline.batch_runtime import BatchRuntime

    path = tmp_path / "plain.onnx"
    graph = helper.make_graph([helper.make_node("ReduceMean", ["src"], ["out"], axes=[1], keepdims=1)], "plain",
                              [helper.make_tensor_value_info("src", TensorProto.FLOAT, [1, 3, HEIGHT, WIDTH])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 1, HEIGHT, WIDTH])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    runtime = load_runtime(load_bare_onnx(path, {"preprocess": PREPROCESS, "postprocess": {"kind": "raw"}}),
                           "onnxruntime")
    batch = BatchRuntime(runtime, 1)
    try:
        outcome = batch.run([frame(0)], ["a"])
        assert len(outcome) == 1 and batch._streams == []
    finally:
        batch.close()
        runtime.close()
    stateful = runtime_of(rvm_like(tmp_path / "rvm.onnx"))
    batch = BatchRuntime(stateful, 1)
    try:
        batch.run([frame(0)], ["a"])
        assert batch._streams == [("a", (120, 160, 3), None)]  # (camera, frame shape, capture time)
    finally:
        batch.close()
        stateful.close()


PACKAGE_STATE = ["--state", "r1i=r1o", "--state", "r2i=r2o", "--state", "r3i=r3o", "--state", "r4i=r4o",
                 "--constant", "downsample_ratio=0.25"]


def _package(rvm: Path, out: Path, extra: list[str]) -> Any:
    from typer.testing import CliRunner

    from deploy.cli import app

    args = ["package", str(rvm), "--name", "rvm", "--version", "1", "--unsigned", "--input-size", f"{WIDTH}x{HEIGHT}",
            "--postprocess", "image", "--param", "output=1", "-o", str(out), *extra]
    return CliRunner().invoke(app, args)


def test_package_writes_the_state_section_from_its_options_and_the_artifact_runs(rvm: Path, tmp_path: Path) -> None:
    from engines.model import load_model_dir

    result = _package(rvm, tmp_path / "out", [*PACKAGE_STATE[:-4], "--state", "r4i=r4o:1,1,1,1", *PACKAGE_STATE[-2:]])
    assert result.exit_code == 0, result.output
    source = load_model_dir(tmp_path / "out")
    assert source.manifest.state == StateSpec.model_validate(
        {**STATE, "pairs": [*STATE["pairs"][:3], {"input": "r4i", "output": "r4o", "init_shape": [1, 1, 1, 1]}]})
    runtime = load_runtime(source, "onnxruntime")
    try:
        results = [runtime.run(frame(i), "a")[0] for i in range(2)]
        assert count_of(runtime, "a") == {2.0}
        assert [int(r.matte.max()) for r in results] == [int(0.01 * k * 255) for k in (1, 2)]  # the constant is fed
    finally:
        runtime.close()
    refused = _package(rvm, tmp_path / "bare", [])  # without the options: refused, saying how to declare them
    assert refused.exit_code != 0 and "--state r1i=r1o" in refused.output, refused.output


@pytest.mark.parametrize("extra, words", [
    (["--state", "r1i"], ["--state 'r1i'", "INPUT=OUTPUT"]),
    (["--state", "r1i=r1o:1,x"], ["init shape", "'1,x'"]),
    (["--constant", "downsample_ratio"], ["--constant 'downsample_ratio'", "NAME=VALUE"]),
    (["--constant", "downsample_ratio=abc"], ["'abc'", "not comma-separated numbers"]),
    (["--constant", "downsample_ratio=inf"], ["downsample_ratio", "finite"]),
    (["--constant", "downsample_ratio=0.25", "--constant", "downsample_ratio=0.5"],
     ["downsample_ratio", "more than once"]),
    (["--state", "r1i=r1o", "--state", "r1i=r2o"], ["r1i", "more than once"]),
    (["--state", "r1i=r9o"], ["r9o", "does not output"]),
], ids=["no-output", "bad-dims", "no-value", "not-a-number", "inf", "constant-twice", "input-twice", "unknown-output"])
def test_package_refuses_a_bad_state_option(rvm: Path, tmp_path: Path, extra: list[str], words: list[str]) -> None:
    result = _package(rvm, tmp_path / "out", [*extra, *_others(extra)])
    assert result.exit_code != 0, result.output
    for word in words:
        assert word in result.output, (word, result.output)
    assert not (tmp_path / "out" / "manifest.json").exists()


def _others(extra: list[str]) -> list[str]:
    """The valid options for every input `extra` does not name, so only the bad one is wrong."""
    named = {e.split("=")[0] for e in extra if not e.startswith("--")}
    out: list[str] = []
    for option, value in zip(PACKAGE_STATE[::2], PACKAGE_STATE[1::2]):
        if value.split("=")[0] not in named:
            out += [option, value]
    return out
