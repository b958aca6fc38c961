"""Batching semantics (nvstreammux): full batch, timeout, no starving, a camera lost and back; and the
batch runtime on the real demo model: one [N, C, H, W] call gives the same results as N batch-1 calls."""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import numpy as np
import pytest

from agent.pipeline.batch_runtime import BatchRuntime
from agent.pipeline.batcher import Batcher
from agent.sources.base import Frame, SourceError
from agent.sources.synthetic import SyntheticConfig, SyntheticScene
from kernel.errors import InferenceError
from tests.helpers import wait_for

IMAGE = np.zeros((8, 8, 3), np.uint8)


class FakeClock:
    """A clock that moves only when the test says so: timeouts fire by decision, not by the wall clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def put(batcher: Batcher, name: str, index: int = 1, at: float = 0.0) -> None:
    batcher.mailbox(name).put(Frame(IMAGE, index, at, name))


def names(batch: list[Frame]) -> list[str]:
    return [f.source for f in batch]


class Waiter:
    """next_batch in a thread, so a test can watch it block and see what releases it."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher, self.stop, self.result = batcher, threading.Event(), None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.result = self.batcher.next_batch(self.stop, idle_s=3600)

    def done(self) -> bool:
        return self.result is not None

    def close(self) -> None:
        self.stop.set()
        with self.batcher.signal:
            self.batcher.signal.notify_all()
        self.thread.join(5)


@pytest.fixture
def waiter() -> Callable[[Batcher], Waiter]:
    started: list[Waiter] = []

    def start(batcher: Batcher) -> Waiter:
        started.append(Waiter(batcher))
        return started[-1]

    yield start
    for w in started:
        w.close()


def test_full_batch_is_sent_when_the_last_camera_delivers(waiter) -> None:
    clock = FakeClock()  # frozen: only fullness can release the batch
    batcher = Batcher(["a", "b"], max_size=2, timeout_s=0.05, clock=clock)
    put(batcher, "a")
    w = waiter(batcher)
    assert not wait_for(w.done, timeout=0.3), "sent before full and before its timeout"
    put(batcher, "b")
    assert wait_for(w.done, timeout=5)
    assert sorted(names(w.result)) == ["a", "b"]


def test_partial_batch_is_sent_when_the_timeout_since_its_first_frame_passes(waiter) -> None:
    clock = FakeClock()
    batcher = Batcher(["a", "b", "c"], max_size=3, timeout_s=0.05, clock=clock)
    put(batcher, "a", at=0.0)
    put(batcher, "b", at=0.01)
    w = waiter(batcher)
    assert not wait_for(w.done, timeout=0.3)
    clock.now = 0.049  # not yet: 49 ms after the first frame
    with batcher.signal:
        batcher.signal.notify_all()
    assert not wait_for(w.done, timeout=0.3)
    clock.now = 0.05
    with batcher.signal:
        batcher.signal.notify_all()
    assert wait_for(w.done, timeout=5)
    assert names(w.result) == ["a", "b"]


def test_replaced_frames_do_not_slide_the_timeout_of_a_batch_waiting_for_a_silent_camera(waiter) -> None:
    """Camera a at ~30 fps, camera b connected but silent, timeout 100 ms: the batch goes 100 ms after a's
    mailbox was first filled, although each new frame of a replaces the unread one (before: the deadline
    counted from the newest frame and moved on with every replacement, so no batch was ever sent)."""
    clock = FakeClock()
    batcher = Batcher(["a", "b"], max_size=2, timeout_s=0.1, clock=clock)
    put(batcher, "a", 0, at=0.0)
    w = waiter(batcher)
    for index in range(1, 5):
        now = round(index * 0.033, 3)
        put(batcher, "a", index, at=now)  # replaces the unread frame: the fill time stays 0.0
        clock.now = now
        with batcher.signal:
            batcher.signal.notify_all()
        if now < 0.1:
            assert not wait_for(w.done, timeout=0.2), f"sent at {now} s, before the timeout"
    assert wait_for(w.done, timeout=5), "a replaced frame moved the batch deadline"
    assert [(f.source, f.index) for f in w.result] == [("a", 4)]
    assert batcher.mailbox("a").dropped == 4


def test_the_mailbox_keeps_its_fill_time_on_a_replace_and_clears_it_on_take() -> None:
    clock = FakeClock()
    batcher = Batcher(["a"], max_size=1, timeout_s=0.0, clock=clock)
    mailbox = batcher.mailbox("a")
    assert mailbox.peek_filled() == (None, None)
    put(batcher, "a", 1)
    clock.now = 0.5
    put(batcher, "a", 2)
    frame, filled_at = mailbox.peek_filled()
    assert frame.index == 2 and filled_at == 0.0
    assert mailbox.take().index == 2 and mailbox.peek_filled() == (None, None)
    put(batcher, "a", 3)
    assert mailbox.peek_filled()[1] == 0.5


def test_a_batch_holds_the_newest_frame_of_each_camera() -> None:
    batcher = Batcher(["a", "b"], max_size=2, timeout_s=0.0)
    put(batcher, "a", 1)
    put(batcher, "a", 2)
    put(batcher, "b", 7)
    batch = batcher.next_batch(threading.Event())
    assert [(f.source, f.index) for f in batch] == [("a", 2), ("b", 7)]
    assert batcher.mailbox("a").dropped == 1 and batcher.dropped == 1


@pytest.mark.parametrize("cameras,max_size", [(4, 2), (3, 2), (5, 3), (4, 1)])
def test_no_camera_starves_when_there_are_more_cameras_than_the_batch(cameras: int, max_size: int) -> None:
    all_names = [f"cam{i}" for i in range(cameras)]
    batcher = Batcher(all_names, max_size=max_size, timeout_s=0.0)
    taken = dict.fromkeys(all_names, 0)
    rounds = cameras * max_size  # every camera ready every time: the worst case for the first camera
    for _ in range(rounds):
        for name in all_names:
            put(batcher, name)
        batch = batcher.next_batch(threading.Event())
        assert len(batch) == max_size and len(set(names(batch))) == max_size
        for name in names(batch):
            taken[name] += 1
    assert set(taken.values()) == {rounds * max_size // cameras}, taken


def test_a_lost_camera_stops_joining_and_does_not_hold_the_batch_back() -> None:
    clock = FakeClock()
    live = {"a": True, "b": True, "c": True}
    batcher = Batcher(["a", "b", "c"], max_size=3, timeout_s=10.0, is_live=live.__getitem__, clock=clock)
    live["c"] = False  # lost: the batch is full with every live camera, no 10 s wait
    put(batcher, "a")
    put(batcher, "b")
    assert names(next_batch_within(batcher, 5)) == ["a", "b"]
    live["c"] = True  # back: its frames join again
    for name in ("a", "b", "c"):
        put(batcher, name)
    assert sorted(names(next_batch_within(batcher, 5))) == ["a", "b", "c"]


def next_batch_within(batcher: Batcher, seconds: float) -> list[Frame]:
    """next_batch with a bound: on a frozen fake clock a batch that waits for a camera never times out, so a
    broken liveness rule fails here in `seconds` instead of hanging the test."""
    w = Waiter(batcher)
    try:
        assert wait_for(w.done, timeout=seconds), "the batch waited for a camera that is not live"
        return w.result
    finally:
        w.close()


def test_idle_and_closed_batcher_return_empty_batches() -> None:
    batcher = Batcher(["a"], max_size=1, timeout_s=0.0)
    assert batcher.next_batch(threading.Event(), idle_s=0.01) == []
    put(batcher, "a")
    batcher.close()
    assert names(batcher.next_batch(threading.Event())) == ["a"]  # what is left, then nothing
    assert batcher.next_batch(threading.Event(), idle_s=5) == []


def test_bad_batcher_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one camera"):
        Batcher([], 1, 0.0)
    with pytest.raises(ValueError, match="max_size"):
        Batcher(["a"], 0, 0.0)


# --- the batch runtime on the real demo model -----------------------------------------------------

@pytest.fixture(scope="module")
def demo_source(tmp_path_factory):
    from agent.artifacts.demo_model import prepare_demo_model_dir
    from engines.model.source import load_model

    return load_model(prepare_demo_model_dir(tmp_path_factory.mktemp("demo"), 160, 128))


def frames(count: int) -> list[np.ndarray]:
    scenes = [SyntheticScene(SyntheticConfig(width=200 + 40 * i, height=150 + 20 * i, seed=i)) for i in range(count)]
    return [scene.render(3) for scene in scenes]


def detections(result) -> list:
    return [(d["text"] if "text" in d else None, [round(v) for v in d["box"]]) for d in result.to_dict()["detections"]]


def test_one_batched_call_equals_batch1_calls_on_the_demo_model(demo_source) -> None:
    from engines.backends import get_backend
    from engines.backends.base import EngineOptions
    from engines.runtime.model_runtime import ModelRuntime, load_runtime

    images = frames(3)
    single = load_runtime(demo_source, "onnxruntime")  # pinned to batch 1, as the agent loads it today
    # an engine that takes batches up to 3 (`max_batch` where the engine side declares it, else a free batch dim)
    fields = {f.name for f in dataclasses.fields(EngineOptions)}
    options = EngineOptions(max_batch=3) if "max_batch" in fields else EngineOptions()
    dynamic = ModelRuntime(demo_source, get_backend("onnxruntime").load(demo_source.onnx_path, options))
    try:
        expected = [single.run(img)[0] for img in images]
        batched = BatchRuntime(dynamic, 3)
        assert batched.batched
        outcomes = batched.run(images, ["a", "b", "c"])
        assert batched.batched, "the dynamic-batch engine fell back to one frame per call"
        assert [detections(o.result) for o in outcomes] == [detections(r) for r in expected]
        assert all(detections(r) for r in expected), "the scenes have text: an empty result proves nothing"
        fallback = BatchRuntime(single, 3)  # a batch-1 engine runs the slots one by one, same results
        assert [detections(o.result) for o in fallback.run(images, ["a", "b", "c"])] == [
            detections(r) for r in expected
        ]
        assert not fallback.batched
    finally:
        single.close()
        dynamic.close()


def test_preprocessing_writes_straight_into_the_batch_slots(demo_source) -> None:
    from engines.model.preprocess import Preprocessor

    images = frames(2)
    spec = demo_source.manifest.preprocess
    batch = np.zeros((2, 3, spec.height, spec.width), np.float32)
    for i, img in enumerate(images):
        Preprocessor(spec)(img, batch[i : i + 1])
    for i, img in enumerate(images):
        alone = Preprocessor(spec)
        alone(img)
        np.testing.assert_array_equal(batch[i], alone.tensor[0])
    with pytest.raises(ValueError, match="shape"):
        Preprocessor(spec)(images[0], batch)


class AtMostTwo:
    """The real ORT engine, declaring that it takes at most 2 frames per call (as a TensorRT profile would)."""

    max_batch = 2

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []
        self.backend, self.inputs, self.outputs = engine.backend, engine.inputs, engine.outputs

    def infer(self, feeds):
        (batch,) = feeds.values()
        assert batch.shape[0] <= self.max_batch, f"a batch of {batch.shape[0]} for an engine that takes 2"
        self.calls.append(batch.shape[0])
        return self.engine.infer(feeds)

    def describe(self):
        return self.engine.describe()

    def close(self) -> None:
        self.engine.close()


def test_a_batch_larger_than_the_engine_takes_is_split_into_calls_it_accepts(demo_source) -> None:
    from engines.backends import get_backend
    from engines.backends.base import EngineOptions
    from engines.runtime.model_runtime import ModelRuntime

    fields = {f.name for f in dataclasses.fields(EngineOptions)}
    options = EngineOptions(max_batch=3) if "max_batch" in fields else EngineOptions()
    inner = get_backend("onnxruntime").load(demo_source.onnx_path, options)
    limited = AtMostTwo(inner)
    runtime = ModelRuntime(demo_source, limited)
    try:
        images = frames(3)
        expected = [detections(runtime.run(img)[0]) for img in images]
        limited.calls.clear()
        outcomes = BatchRuntime(runtime, 3).run(images, ["a", "b", "c"])
        assert limited.calls == [2, 1]
        assert [detections(o.result) for o in outcomes] == expected
    finally:
        runtime.close()


class UndecodableFrame(Frame):
    """A lazily decoded frame whose decode fails (agent.sources.lazy raises CAMERA_BAD_FRAME then)."""

    @property
    def image(self):
        raise SourceError("b: the source was closed before the frame was used", code="CAMERA_BAD_FRAME")

    @image.setter
    def image(self, value) -> None:
        pass


def test_a_frame_that_fails_to_decode_leaves_the_rest_of_its_batch_running(demo_source) -> None:
    from agent.pipeline.frame_stats import FrameStats
    from agent.pipeline.worker import InferenceWorker
    from engines.runtime.model_runtime import load_runtime

    runtime = load_runtime(demo_source, "onnxruntime")
    batcher = Batcher(["a", "b"], max_size=2, timeout_s=0.0)
    batcher.mailbox("a").put(Frame(frames(1)[0], 1, 0.0, "a"))
    batcher.mailbox("b").put(UndecodableFrame(IMAGE, 1, 0.0, "b"))
    stop, stats = threading.Event(), FrameStats()
    worker = InferenceWorker(runtime, batcher, stop, stats)
    worker.start()
    try:
        assert wait_for(lambda: stats.frames >= 1, timeout=60)
    finally:
        stop.set()
        worker.join(5)
        runtime.close()
    assert stats.errors == 0 and worker.cameras.of("a").frames == 1 and worker.cameras.of("b").frames == 0


class FailsOnce(AtMostTwo):
    """The real ORT engine (batches up to 2) with one passing fault, as a CUDA hiccup or a busy DLA would give."""

    def __init__(self, engine, error: Exception | None = None) -> None:
        super().__init__(engine)
        self.error = error

    def infer(self, feeds):
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().infer(feeds)


@pytest.mark.parametrize("message", [
    "m.onnx: execute_async_v3 failed (see the TensorRT log)",
    # words a message-reading check once took for a refusal: only the code says that
    "m.onnx: input x rejects shape: a batch of 2 hit an invalid dimensions check in a plugin",
])
def test_a_passing_engine_error_fails_one_batch_and_batching_goes_on(demo_source, message: str) -> None:
    from engines.backends import get_backend
    from engines.backends.base import EngineOptions
    from engines.runtime.model_runtime import ModelRuntime

    inner = get_backend("onnxruntime").load(demo_source.onnx_path, EngineOptions(max_batch=2))
    engine = FailsOnce(inner, InferenceError(message))
    runtime = ModelRuntime(demo_source, engine)
    try:
        batch = BatchRuntime(runtime, 2)
        with pytest.raises(InferenceError) as info:
            batch.run(frames(2), ["a", "b"])  # the worker counts this batch as failed
        assert info.value.code == "INFERENCE_FAILED"
        assert batch.batched, "one passing engine error turned batching off for good"
        batch.run(frames(2), ["a", "b"])
        assert batch.batched and engine.calls == [2]  # the next batch ran as one call
    finally:
        runtime.close()


def test_an_engine_pinned_to_batch_one_refuses_by_code_and_the_batch_falls_back(demo_source, caplog) -> None:
    from engines.runtime.model_runtime import ModelRuntime, load_runtime

    single = load_runtime(demo_source, "onnxruntime")  # pinned to batch 1
    images = frames(2)
    pair = np.concatenate([single.preprocessor.tensor] * 2)
    with pytest.raises(InferenceError) as refused:
        single.engine.infer({single.input_name: pair})
    assert refused.value.code == "BATCH_SIZE_UNSUPPORTED"
    engine = AtMostTwo(single.engine)  # ... behind a wrapper that claims 2 (a stale profile, a wrong sidecar)
    runtime = ModelRuntime(demo_source, engine)
    try:
        expected = [detections(runtime.run(img)[0]) for img in images]
        engine.calls.clear()
        batch = BatchRuntime(runtime, 2)
        assert batch.batched
        with caplog.at_level("WARNING", logger="agent.pipeline.batch_runtime"):
            assert [detections(o.result) for o in batch.run(images, ["a", "b"])] == expected
        assert not batch.batched and engine.calls == [2, 1, 1]  # refused once, then one frame per call
        assert "BATCH_SIZE_UNSUPPORTED" in caplog.text
        batch.run(images, ["a", "b"])
        assert engine.calls == [2, 1, 1, 1, 1]  # and never asks for the refused size again
    finally:
        runtime.close()


class Stuck:
    """Batches from a source that holds the worker inside `next_batch` until the test lets it go."""

    max_size = 1

    def __init__(self) -> None:
        self.inside, self.release = threading.Event(), threading.Event()

    def next_batch(self, stop: threading.Event, idle_s: float = 0.2) -> list[Frame]:
        self.inside.set()
        self.release.wait(30)  # bounded: a broken test fails, never hangs
        stop.wait(0.001)  # idle turn: nothing to batch
        return []


def test_a_swap_that_timed_out_is_never_installed_later(demo_source) -> None:
    from agent.pipeline.frame_stats import FrameStats
    from agent.pipeline.worker import InferenceWorker
    from kernel.errors import EdgeError
    from engines.runtime.model_runtime import load_runtime

    old, new = load_runtime(demo_source, "onnxruntime"), load_runtime(demo_source, "onnxruntime")
    source, stop = Stuck(), threading.Event()
    worker = InferenceWorker(old, source, stop, FrameStats())
    worker.start()
    try:
        assert source.inside.wait(30)
        with pytest.raises(EdgeError) as info:
            worker.swap(new, timeout=0.05)  # the loop is stuck in a batch: the caller is told the swap failed
        assert info.value.code == "SWAP_TIMEOUT"
        source.release.set()
        turns = worker.heartbeat
        assert wait_for(lambda: worker.heartbeat > turns + 2, timeout=30)  # boundaries passed since
        assert worker.runtime is old, "the worker installed a swap its caller was told had failed"
        assert worker.swap(new) is old and worker.runtime is new  # a later swap still works
    finally:
        stop.set()
        worker.join(5)
        old.close()
        new.close()


def test_a_swap_sets_the_new_batch_size_between_two_batches(demo_source) -> None:
    from agent.pipeline.frame_stats import FrameStats
    from agent.pipeline.worker import InferenceWorker
    from engines.runtime.model_runtime import load_runtime

    runtime = load_runtime(demo_source, "onnxruntime")
    batcher = Batcher(["a", "b"], max_size=1, timeout_s=0.0)
    stop, stats = threading.Event(), FrameStats()
    worker = InferenceWorker(runtime, batcher, stop, stats)
    worker.start()
    try:
        assert worker.swap(runtime, batch_size=2) is runtime
        assert batcher.max_size == 2 and worker.batch.max_size == 2
        image = frames(1)[0]
        batcher.mailbox("a").put(Frame(image, 1, 0.0, "a"))
        batcher.mailbox("b").put(Frame(image, 1, 0.0, "b"))
        assert wait_for(lambda: stats.frames + stats.errors >= 2, timeout=60)
        assert stats.frames == 2 and worker.batches == 1  # both cameras in one batch of the new size
        worker.swap(runtime, batch_size=1)
        assert batcher.max_size == 1 and worker.batch.max_size == 1
    finally:
        stop.set()
        worker.join(5)
        runtime.close()
