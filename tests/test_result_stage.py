"""Finishing batch k (postprocess, stats, results) while the engine runs batch k+1 (agent.pipeline.result_stage,
`[pipeline] overlap_postprocess`): order, backpressure, swaps and pauses that never mix two models' numbers.

The worker tests run the real demo model (PP-OCRv4 det, ONNX Runtime) with the engine call and the postprocessor
wrapped to record and gate what happens when; nothing is timed against a wall-clock threshold."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from agent.pipeline.frame_stats import FrameStats
from agent.pipeline.mailbox import FreshestMailbox
from agent.pipeline.result_stage import ResultStage
from agent.pipeline.worker import InferenceWorker
from agent.sources.base import Frame
from agent.sources.synthetic import SyntheticConfig, SyntheticScene
from kernel.errors import EdgeError
from tests.helpers import wait_for


# --- the stage on its own ---------------------------------------------------------------------------

def test_items_are_handled_in_order_one_at_a_time() -> None:
    handled, busy, overlapped = [], threading.Event(), []

    def handle(item: int) -> None:
        overlapped.append(busy.is_set())
        busy.set()
        time.sleep(0.002)
        handled.append(item)
        busy.clear()

    stage = ResultStage(handle)
    stage.start()
    for i in range(20):
        stage.submit(i)
        assert stage._submitted - stage._handled <= 1, "more than one batch waited for its results"
    stage.close(5)
    assert handled == list(range(20)) and not any(overlapped) and not stage.is_alive()


def test_submit_waits_until_the_previous_item_is_handled() -> None:
    release, started = threading.Event(), threading.Event()
    stage = ResultStage(lambda item: (started.set(), release.wait(10)))
    stage.start()
    stage.submit(1)
    assert started.wait(10) and not stage.drain(0)
    second = threading.Thread(target=stage.submit, args=(2,))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "a second batch was handed over while the first was still being finished"
    assert not stage.drain(0.05)
    release.set()
    second.join(10)
    assert stage.drain(10)
    stage.close(5)


@pytest.mark.parametrize("error", [RuntimeError("a bug in one sink"), SystemExit("a bug in one sink")])
def test_a_failing_handler_does_not_end_the_stage(caplog, error: BaseException) -> None:
    handled = []

    def handle(item: int) -> None:
        if item == 1:
            raise error
        handled.append(item)

    stage = ResultStage(handle)
    stage.start()
    for i in range(3):
        stage.submit(i)
    assert stage.drain(10) and handled == [0, 2] and stage.is_alive()
    assert "a bug in one sink" in caplog.text
    stage.close(5)


def test_items_submitted_to_a_stage_that_is_not_running_are_handled_inline() -> None:
    handled: list[tuple[int, str]] = []
    stage = ResultStage(lambda item: handled.append((item, threading.current_thread().name)))
    stage.submit(1)  # never started
    stage.start()
    stage.close(5)
    stage.submit(2)  # closed
    here = threading.current_thread().name
    assert handled == [(1, here), (2, here)]


# --- the worker on the demo model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_source(tmp_path_factory):
    from agent.artifacts.demo_model import prepare_demo_model_dir
    from engines.model.source import load_model

    return load_model(prepare_demo_model_dir(tmp_path_factory.mktemp("demo"), 160, 128))


@pytest.fixture()
def runtime(demo_source):
    from engines.runtime.model_runtime import load_runtime

    runtime = load_runtime(demo_source, "onnxruntime")
    yield runtime
    runtime.close()


def image(seed: int = 1):
    return SyntheticScene(SyntheticConfig(width=200, height=150, seed=seed)).render(3)


class Recorder:
    """Wraps a runtime's engine call and postprocessor: logs ("infer"/"post", batch number) in order, can hold
    the postprocessing of one batch until released, and feeds the next frame when the engine starts a batch."""

    def __init__(self, runtime, mailbox: FreshestMailbox, frames: int) -> None:
        self.events: list[tuple[str, int]] = []
        self.calls = 0
        self.posts = 0
        self.hold_post: dict[int, threading.Event] = {}
        self.second_infer = threading.Event()
        self._mailbox, self._frames = mailbox, frames
        infer, post = runtime.engine.infer, runtime.postprocessor

        def recorded_infer(feeds):
            self.calls += 1
            self.events.append(("infer", self.calls))
            if self.calls == 2:
                self.second_infer.set()
            if self.calls < self._frames:
                self._mailbox.put(Frame(image(self.calls + 1), self.calls + 1, time.monotonic(), "cam"))
            return infer(feeds)

        def recorded_post(outputs, transform):
            self.posts += 1
            number = self.posts
            self.events.append(("post", number))
            gate = self.hold_post.get(number)
            if gate is not None:
                gate.wait(30)
            self.events.append(("posted", number))
            return post(outputs, transform)

        runtime.engine.infer = recorded_infer
        runtime.postprocessor = recorded_post


def start_worker(runtime, overlap: bool, frames: int = 2):
    mailbox: FreshestMailbox[Frame] = FreshestMailbox()
    recorder = Recorder(runtime, mailbox, frames)
    stop, stats = threading.Event(), FrameStats()
    worker = InferenceWorker(runtime, mailbox, stop, stats, overlap_postprocess=overlap)
    worker.start()
    return worker, stop, stats, mailbox, recorder


def stop_worker(worker: InferenceWorker, stop: threading.Event) -> None:
    stop.set()
    worker.join(10)
    assert not worker.is_alive() and (worker.results is None or not worker.results.is_alive())


@contextlib.contextmanager
def first_batch_held(runtime, overlap: bool = True, frames: int = 1):
    """A running worker whose batch 1 has been inferred and is held in postprocessing (released, and the worker
    stopped, on exit): (worker, stats, recorder, held, stop)."""
    worker, stop, stats, mailbox, recorder = start_worker(runtime, overlap, frames)
    recorder.hold_post[1] = held = threading.Event()
    try:
        mailbox.put(Frame(image(), 1, time.monotonic(), "cam"))
        assert wait_for(lambda: ("post", 1) in recorder.events, timeout=60)
        yield worker, stats, recorder, held, stop
    finally:
        held.set()
        stop_worker(worker, stop)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_engine_runs_the_next_batch_while_the_previous_one_is_postprocessed(runtime, overlap: bool) -> None:
    """With overlap, batch 2's engine call starts while batch 1's postprocessing is held; without, it cannot."""
    with first_batch_held(runtime, overlap, frames=2) as (worker, stats, recorder, held, _):
        assert recorder.second_infer.wait(10 if overlap else 0.5) is overlap
        held.set()
        assert wait_for(lambda: stats.frames == 2, timeout=60)
        if overlap:
            assert recorder.events.index(("infer", 2)) < recorder.events.index(("posted", 1))
        else:
            assert recorder.events == [
                ("infer", 1),
                ("post", 1),
                ("posted", 1),
                ("infer", 2),
                ("post", 2),
                ("posted", 2),
            ]
        assert worker.cameras.of("cam").frames == 2 and worker.batches == 2 and stats.errors == 0


def test_a_swap_returns_once_the_old_models_last_batch_has_its_results(runtime) -> None:
    """The deployment watch reads `worker.window` and the adapt controller clears its latency window when `swap`
    returns: the old model's last batch, still being finished, must land in the old window and before that."""
    with first_batch_held(runtime) as (worker, stats, recorder, held, _):
        old_window, returned = worker.window, []
        swapping = threading.Thread(target=lambda: returned.append(worker.swap(runtime)))
        swapping.start()
        assert wait_for(lambda: worker.window is not old_window, timeout=30)  # installed at the batch boundary
        swapping.join(0.3)
        assert swapping.is_alive(), "swap returned while the old model's last batch was still being finished"
        held.set()
        swapping.join(30)
        assert returned == [runtime] and stats.frames == 1  # no waiting: delivered before swap returned
        # in the old window: left out of its judged frames as a model's first batch is (captured before its first
        # result)
        assert old_window.excluded == 1 and worker.window.frames == worker.window.excluded == 0
        assert worker.camera_windows.of("cam").frames == 0


def test_pause_returns_only_when_the_last_batch_has_its_results(runtime) -> None:
    """A stop_start swap closes the engine once paused: nothing of the last batch may still be running."""
    with first_batch_held(runtime) as (worker, stats, recorder, held, _):
        with pytest.raises(EdgeError) as info:
            worker.pause(timeout=0.3)
        assert info.value.code == "SWAP_TIMEOUT"
        assert not worker._pause_requested, "a pause that failed left the loop paused for good"
        held.set()
        worker.pause(timeout=30)
        assert stats.frames == 1 and worker.results is not None and worker.results.drain(0)
        worker.resume()


def test_stopping_the_worker_still_delivers_the_batch_in_flight(runtime) -> None:
    with first_batch_held(runtime) as (worker, stats, recorder, held, stop):
        stop.set()
        held.set()
        worker.join(10)
        assert stats.frames == 1 and not worker.is_alive()


def test_engine_and_postprocessing_errors_count_in_order_on_one_thread(runtime) -> None:
    """Engine errors are recorded by the result stage too, so `consecutive_errors` has one writer."""
    mailbox: FreshestMailbox[Frame] = FreshestMailbox()
    stop, stats = threading.Event(), FrameStats()

    def broken_post(outputs, transform):
        raise ValueError("postprocessor cannot read this output")

    runtime.postprocessor = broken_post
    worker = InferenceWorker(runtime, mailbox, stop, stats, max_consecutive_errors=3, overlap_postprocess=True)
    worker.start()
    try:
        for i in range(3):
            mailbox.put(Frame(image(), i, time.monotonic(), "cam"))
            assert wait_for(lambda: stats.errors == i + 1, timeout=60)
        assert worker.degraded and stats.frames == 0 and worker.cameras.of("cam").errors == 3
    finally:
        stop_worker(worker, stop)


def test_errors_of_a_replaced_model_never_count_against_the_new_one(runtime, demo_source) -> None:
    """`degraded` is about the model serving now: a swap away from a failing model clears it at once, and the
    old model's batches still being finished do not count for the new one."""
    from engines.runtime.model_runtime import load_runtime

    mailbox: FreshestMailbox[Frame] = FreshestMailbox()
    stop, stats = threading.Event(), FrameStats()

    def broken_post(outputs, transform):
        raise ValueError("postprocessor cannot read this output")

    runtime.postprocessor = broken_post
    good = load_runtime(demo_source, "onnxruntime")
    worker = InferenceWorker(runtime, mailbox, stop, stats, max_consecutive_errors=1, overlap_postprocess=True)
    worker.start()
    try:
        mailbox.put(Frame(image(), 1, time.monotonic(), "cam"))
        assert wait_for(lambda: worker.degraded, timeout=60)
        worker.swap(good)
        assert not worker.degraded
        mailbox.put(Frame(image(), 2, time.monotonic(), "cam"))
        assert wait_for(lambda: stats.frames == 1, timeout=60)
        assert not worker.degraded and worker.consecutive_errors == 0 and stats.errors == 1
    finally:
        stop_worker(worker, stop)
        good.close()


def test_frames_that_waited_through_a_swap_are_left_out_of_the_new_models_window(runtime) -> None:
    """The deployment watch judges the new model from its first result on (issue 27): a frame captured before
    that waited through the swap gap, so its latency is the gap's. It still counts in the run's totals."""
    worker, stop, stats, mailbox, _ = start_worker(runtime, overlap=True, frames=0)
    try:
        mailbox.put(Frame(image(), 1, time.monotonic(), "cam"))
        assert wait_for(lambda: stats.frames == 1, timeout=60)
        before_swap = time.monotonic() - 0.5  # as if it had waited half a second in the mailbox
        worker.swap(runtime)
        window = worker.window
        assert window.opened_at is None and window.frames == 0
        mailbox.put(Frame(image(), 2, before_swap, "cam"))
        assert wait_for(lambda: stats.frames == 2, timeout=60)
        assert window.opened_at is not None and window.started == window.opened_at
        assert window.frames == 0 and window.excluded == 1 and not worker.camera_windows.items()
        mailbox.put(Frame(image(), 3, time.monotonic(), "cam"))
        assert wait_for(lambda: stats.frames == 3, timeout=60)
        assert window.frames == 1 and worker.camera_windows.of("cam").frames == 1
        assert worker.cameras.of("cam").frames == 3
        assert window.latency.percentile(100) < stats.latency.percentile(100)  # the 500 ms frame is not in it
    finally:
        stop_worker(worker, stop)
