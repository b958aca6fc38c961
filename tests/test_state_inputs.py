"""State inputs (manifest `state`) at run time: recurrent state fed back from outputs per camera, and constants;
state carried per stream across resets, swaps and camera restarts, and through the real agent with two cameras.

The model is tests/rvm_model.py's stand-in for Robust Video Matting, whose outputs count the frames of their
stream. The manifest's `state` checked against the model, plans and packaging: test_state_manifest.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kernel.errors import ModelError
from engines.model.manifest import StateSpec, parse_manifest
from engines.model.source import load_bare_onnx
from engines.runtime.model_runtime import load_runtime
from tests.rvm_model import HEIGHT, MATTE, PREPROCESS, STATE, WIDTH, count_of, frame, runtime_of, rvm_like


@pytest.fixture
def rvm(tmp_path: Path) -> Path:
    return rvm_like(tmp_path / "rvm.onnx")


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
    from engines.runtime.batching import STATE_BATCH_REASON
    from kernel.errors import BatchSizeError

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
    from engines.model.manifest import Gates
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
    from agent.config.tree import AgentConfig
    from agent.daemon.runner import Agent
    from engines.runtime.batching import STATE_BATCH_REASON
    from engines.model.manifest import Gates, Manifest, ModelFile
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
    from kernel.errors import EdgeError

    serving = load_bare_onnx(rvm, {"preprocess": PREPROCESS, "postprocess": MATTE, "state": STATE})
    slots = SimpleNamespace(active=SimpleNamespace(source=serving))
    host = ShadowHost(slots, loader=None, config=None, throttled=lambda: False, adapt_over_limit=lambda: False)
    with pytest.raises(EdgeError) as info:
        host.check_comparable(serving)  # same kind as the serving model: refused for its state alone
    assert info.value.code == "SHADOW_INCOMPARABLE"
    assert "every frame of its camera in order" in str(info.value)
    plain = serving.manifest.model_copy(update={"state": None})
    host.check_comparable(SimpleNamespace(manifest=plain, label="plain"))  # the same without state shadows


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
