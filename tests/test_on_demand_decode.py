"""Live cameras retrieve only the grabs the consumer will take (agent.pipeline.demand, agent.pipeline.on_demand).

The estimator is checked as a pure function over recorded take and grab times. The capture thread is
driven by a fake blocking source standing in for cv2.VideoCapture over V4L2 or FFmpeg: `grab` sleeps
to the next frame time of a 30 fps camera (as a device or a stream blocks), `retrieve` counts and
returns an image stamped with the grab's number. Assertions are on counts and indices, not timings.
Last, the real FFmpeg path: the `url` source on a stream served by ffmpeg, read by a slow consumer.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, ClassVar, Iterator

import numpy as np
import pytest

from agent.pipeline.capture import CaptureThread
from agent.pipeline.demand import DemandEstimator, take_due_before_next_grab
from agent.pipeline.mailbox import FreshestMailbox
from agent.pipeline.summary import CAPTURE_FIELDS
from agent.sources import create_source
from agent.sources.base import Frame
from agent.sources.live import LiveSourceConfig
from agent.sources.url import UrlConfig
from tests.test_capture import StreamServer, free_port, wait_for

CAMERA_FPS = 30.0


# --- the estimator, pure --------------------------------------------------------------------------


def test_take_due_before_next_grab_with_margin() -> None:
    # last take at 1.0, every 0.1 s: the next take is due at 1.1; grabs every 1/30 s.
    assert take_due_before_next_grab(1.08, 1.0, 0.1, 1 / 30)  # due before the next grab
    assert not take_due_before_next_grab(1.03, 1.0, 0.1, 1 / 30)  # due two grabs from now
    assert not take_due_before_next_grab(1.065, 1.0, 0.1, 1 / 30)  # just after the next grab: that one serves it
    assert take_due_before_next_grab(1.065, 1.0, 0.1, 1 / 30, margin_s=0.002)  # ... unless its retrieve is late
    assert take_due_before_next_grab(1.5, 1.0, 0.1, 1 / 30)  # overdue: the consumer is waiting


def replay(grabs: list[float], takes: list[float], retrieve_s: float = 0.001) -> list[bool]:
    """The decision after each grab, given the take times a mailbox would have reported by then."""
    estimator, decisions = DemandEstimator(), []
    for grab in grabs:
        seen = [t for t in takes if t <= grab]
        estimator.observe_grab(grab)
        estimator.observe_takes(len(seen), seen[-1] if seen else None)
        decisions.append(estimator.should_retrieve(grab))
        if decisions[-1]:
            estimator.observe_retrieve(retrieve_s)
    return decisions


def test_estimator_retrieves_everything_until_it_has_history() -> None:
    grabs = [i / 30 for i in range(1, 7)]
    assert replay(grabs, takes=[]) == [True] * 6  # no take yet
    assert replay(grabs, takes=[0.05]) == [True] * 6  # one take: no interval yet


def test_estimator_retrieves_about_one_grab_per_take_for_a_slow_consumer() -> None:
    grabs = [i / 30 for i in range(1, 301)]  # 10 s of a 30 fps camera
    takes = [0.01 + i / 10 for i in range(100)]  # a 10 fps consumer, each take 10 ms after a grab
    decisions = replay(grabs, takes)
    steady = decisions[30:]  # after the first second
    assert 0.3 <= sum(steady) / len(steady) <= 0.37  # one grab in three: the one just before each take
    for take in takes[10:]:  # a frame was retrieved at the last grab before every take
        last_grab = max(i for i, g in enumerate(grabs) if g <= take)
        assert decisions[last_grab], f"no frame retrieved for the take at {take:.3f}"


def test_estimator_retrieves_every_grab_for_a_fast_consumer() -> None:
    grabs = [i / 30 for i in range(1, 301)]
    takes = [g + 0.002 for g in grabs]  # takes each frame as soon as it is put
    assert all(replay(grabs, takes)[2:])


def test_estimator_margin_is_the_retrieve_time() -> None:
    grabs = [i / 30 for i in range(1, 301)]
    takes = [g + 0.003 for g in grabs[2::3]]  # 10 fps, each take 3 ms after every third grab
    quick = replay(grabs, takes, retrieve_s=0.001)[30:]
    slow = replay(grabs, takes, retrieve_s=0.005)[30:]  # the frame of the grab before a take is ready too late
    assert sum(quick) / len(quick) <= 0.37 and sum(slow) / len(slow) >= 0.6


def test_estimator_retrieves_when_the_consumer_is_overdue() -> None:
    estimator = DemandEstimator()
    for t in (0.0, 0.1, 0.2):
        estimator.observe_takes(int(t * 10) + 1, t)
    for i in range(8):
        estimator.observe_grab(0.2 + i / 30)
    assert not estimator.should_retrieve(0.21)  # the next take is due at 0.3
    assert estimator.should_retrieve(0.45)  # past due: the consumer is waiting or about to take


@pytest.mark.parametrize("kwargs", [{"smoothing": 0.0}, {"smoothing": 1.5}])
def test_estimator_rejects_bad_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DemandEstimator(**kwargs)


# --- the capture thread with a fake blocking source -----------------------------------------------


class BlockingCamera:
    """Stands in for cv2.VideoCapture over V4L2/FFmpeg: grab blocks to the next 30 fps frame, retrieve counts."""

    Config: ClassVar[type[LiveSourceConfig]] = LiveSourceConfig
    paced: ClassVar[bool] = False

    def __init__(self, decode: str) -> None:
        self.config = LiveSourceConfig(name="live", decode=decode)
        self.grabs = 0
        self.retrieves = 0
        self._start = 0.0

    def open(self) -> None:
        """Starts the frame clock."""
        self._start = time.monotonic()

    def grab(self) -> bool:
        """Block until the next frame time, as a device or a stream does."""
        due = self._start + (self.grabs + 1) / CAMERA_FPS
        time.sleep(max(0.0, due - time.monotonic()))
        self.grabs += 1
        return True

    def retrieve(self) -> np.ndarray:
        """The last grab, stamped with its number (the decode a skipped grab never pays)."""
        self.retrieves += 1
        return np.full((16, 16, 3), self.grabs % 256, np.uint8)

    def read(self) -> np.ndarray:
        """What VideoCapture.read does."""
        self.grab()
        return self.retrieve()

    def close(self) -> None:
        """Nothing to release."""

    def frame_interval_s(self) -> None:
        """The device paces itself."""
        return None


class TakeRecordingMailbox(FreshestMailbox[Frame]):
    """A real mailbox that notes, at each take and under its lock, the frame taken and the camera's newest grab."""

    def __init__(self, camera: BlockingCamera) -> None:
        super().__init__()
        self.camera = camera
        self.taken: list[tuple[Frame, int]] = []

    def take(self) -> Frame | None:
        with self._cond:  # re-entrant: super().take() takes it again
            frame = super().take()
            if frame is not None:
                self.taken.append((frame, self.camera.grabs))
            return frame


@pytest.fixture
def run_camera() -> Iterator[Callable[[str], tuple[CaptureThread, TakeRecordingMailbox, BlockingCamera]]]:
    started: list[tuple[CaptureThread, threading.Event]] = []

    def start(decode: str) -> tuple[CaptureThread, TakeRecordingMailbox, BlockingCamera]:
        camera = BlockingCamera(decode)
        mailbox, stop = TakeRecordingMailbox(camera), threading.Event()
        thread = CaptureThread(camera, mailbox, stop)
        started.append((thread, stop))
        thread.start()
        return thread, mailbox, camera

    yield start
    for thread, stop in started:
        stop.set()
        thread.join(10)
        assert not thread.is_alive()


def consume(mailbox: FreshestMailbox[Frame], takes: int, every_s: float) -> None:
    """A consumer at 1/every_s fps: wakes on its own clock and takes the newest frame (waiting for one if none)."""
    due = time.monotonic()
    for _ in range(takes):
        due += every_s
        time.sleep(max(0.0, due - time.monotonic()))
        assert mailbox.get(timeout=5) is not None


def assert_fresh_and_genuine(mailbox: TakeRecordingMailbox) -> None:
    """Every frame taken is the newest grab or the one before it, and its pixels are that grab's."""
    for frame, newest in mailbox.taken:
        assert newest - 1 <= frame.index <= newest, f"took frame {frame.index} when grab {newest} was the newest"
        assert int(frame.image[0, 0, 0]) == frame.index % 256


def test_slow_consumer_on_a_30fps_camera_gets_fresh_frames_from_few_retrieves(run_camera: Any) -> None:
    thread, mailbox, camera = run_camera("on_demand")
    consume(mailbox, takes=5, every_s=0.1)  # the estimator learns both rates
    grabbed, decoded = thread.stats.grabbed, thread.stats.decoded
    consume(mailbox, takes=30, every_s=0.1)
    grabbed, decoded = thread.stats.grabbed - grabbed, thread.stats.decoded - decoded
    assert grabbed >= 60  # three grabs per take, less scheduling noise
    assert decoded <= 0.6 * grabbed, f"{decoded} retrieves for {grabbed} grabs"
    assert decoded >= 30  # each take got a frame of its own, and each frame put was retrieved once
    assert camera.retrieves == thread.stats.decoded and camera.grabs >= thread.stats.grabbed
    assert thread.stats.skipped == thread.stats.grabbed - thread.stats.decoded > 0
    assert_fresh_and_genuine(mailbox)
    assert mailbox.dropped > 0  # frames retrieved but overtaken (or discarded as stale) count as drops


def test_every_frame_retrieves_each_grab(run_camera: Any) -> None:
    thread, mailbox, camera = run_camera("every_frame")
    consume(mailbox, takes=10, every_s=0.1)
    thread.stop_event.set()  # the counters are read once the thread has stopped: mid-read they can differ by one
    thread.join(10)
    assert thread.on_demand is None
    assert thread.stats.decoded == thread.stats.grabbed == camera.retrieves >= 20
    assert thread.stats.skipped == 0
    assert_fresh_and_genuine(mailbox)


def test_fast_consumer_gets_nearly_every_frame_retrieved(run_camera: Any) -> None:
    thread, mailbox, camera = run_camera("on_demand")
    consume(mailbox, takes=60, every_s=0.0)  # waits for each frame: as fast as the camera
    assert thread.stats.decoded >= 0.9 * thread.stats.grabbed, thread.stats
    assert_fresh_and_genuine(mailbox)


def test_capture_counters_are_reported_under_the_same_names() -> None:
    assert {"grabbed", "decoded", "skipped"} <= set(CAPTURE_FIELDS)


# --- the real FFmpeg path ---------------------------------------------------------------------------


@pytest.fixture
def stream() -> Iterator[StreamServer]:
    import shutil
    import tempfile
    from pathlib import Path

    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg not installed (make system-deps)")
    with tempfile.TemporaryDirectory() as folder:
        server = StreamServer(free_port(), Path(folder) / "ffmpeg.log")
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.mark.slow
def test_url_stream_with_a_slow_consumer_decodes_fewer_frames_than_it_grabs(stream: StreamServer) -> None:
    source = create_source(UrlConfig(name="gate", url=f"tcp://127.0.0.1:{stream.port}", read_timeout_ms=3000))
    mailbox: FreshestMailbox[Frame] = FreshestMailbox()
    stop = threading.Event()
    thread = CaptureThread(source, mailbox, stop)
    thread.start()
    try:
        wait_for(lambda: thread.stats.frames >= 5, "frames from the stream")
        consume(mailbox, takes=15, every_s=0.25)  # 4 fps against the stream's 25
        stats = thread.stats
        assert thread.on_demand is not None and stats.grabbed >= 30
        assert stats.decoded < stats.grabbed and stats.skipped > 0, stats
        frame = mailbox.get(timeout=5)
        assert frame is not None and frame.image.shape == (240, 320, 3)
    finally:
        stop.set()
        mailbox.close()
        thread.join(10)
    assert not thread.is_alive()
