"""Frames that will be dropped cost (almost) nothing: counted renders, grabs and decodes on real sources.

A camera faster than its consumer has most frames replaced in the mailbox unread. The synthetic camera
draws its scene once; a video file is grabbed every frame (inter-frame codecs need that) but converted
only for the frames the consumer takes. Counts come from the real cv2.VideoCapture of a real video.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import cv2
import numpy as np
import pytest

from agent.pipeline.capture import CaptureThread
from agent.pipeline.mailbox import FreshestMailbox
from agent.sources.base import Frame, LazyFrame, SourceError
from agent.sources.file import FileConfig, FileSource
from agent.sources.lazy import LazyGrabber
from agent.sources.synthetic import SyntheticConfig, SyntheticScene, SyntheticSource
from tests.helpers import wait_for
from tests.test_sources import VIDEO_FRAMES, decode_index, write_numbered_video

CONSUMED = 12
CAMERA_FRAMES_PER_TAKE = 3  # the consumer takes one frame per this many the camera delivers


class CountingVideoCapture:
    """The real cv2.VideoCapture, with its calls counted (read = grab + retrieve in one call)."""

    def __init__(self, cap: cv2.VideoCapture) -> None:
        self._cap = cap
        self.calls = {"grab": 0, "retrieve": 0, "read": 0}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._cap, name)
        if name in self.calls:
            def counted(*args: Any) -> Any:
                self.calls[name] += 1
                return attr(*args)
            return counted
        return attr


class CountingFileSource(FileSource):
    """A real FileSource whose VideoCapture calls are counted across reopens and rewinds."""

    def __init__(self, config: FileConfig) -> None:
        super().__init__(config)
        self.counters: list[CountingVideoCapture] = []

    def _open_video(self) -> None:
        super()._open_video()
        counting = CountingVideoCapture(self._capture._cap)
        self._capture._cap = counting
        self.counters.append(counting)

    def count(self, name: str) -> int:
        return sum(c.calls[name] for c in self.counters)

    def decodes(self) -> int:
        """Frames converted to BGR: every read, every retrieve."""
        return self.count("read") + self.count("retrieve")


class RecordingMailbox(FreshestMailbox[Frame]):
    """A real mailbox that records every value its counters are set to.

    The mailbox only ever adds one to a counter, under its lock; a value that goes down was edited from
    outside (a reader of the counters could have seen it half done)."""

    def __init__(self) -> None:
        self.history: dict[str, list[int]] = {"delivered": [], "dropped": []}
        super().__init__()

    delivered = property(lambda self: self.history["delivered"][-1],
                         lambda self, value: self.history["delivered"].append(value))
    dropped = property(lambda self: self.history["dropped"][-1],
                       lambda self, value: self.history["dropped"].append(value))

    def only_counted_up(self) -> bool:
        """True when each counter moved 0, 1, 2, ... one step at a time."""
        return all(values == list(range(len(values))) for values in self.history.values())


class SlowConsumer:
    """Takes one frame each time the camera has delivered `CAMERA_FRAMES_PER_TAKE` more (no sleeps)."""

    def __init__(self, thread: CaptureThread, mailbox: FreshestMailbox[Frame]) -> None:
        self.thread, self.mailbox = thread, mailbox
        self.taken: list[tuple[Frame, np.ndarray]] = []

    def take(self, count: int) -> None:
        for _ in range(count):
            mark = self.thread.stats.frames
            assert wait_for(lambda: self.thread.stats.frames >= mark + CAMERA_FRAMES_PER_TAKE, timeout=30)
            frame = self.mailbox.get(timeout=10)
            assert frame is not None
            self.taken.append((frame, frame.image))


@pytest.fixture
def run_capture() -> Iterator[Any]:
    started: list[tuple[CaptureThread, threading.Event]] = []

    def start(
        source: Any, mailbox: FreshestMailbox[Frame] | None = None
    ) -> tuple[CaptureThread, FreshestMailbox[Frame]]:
        mailbox = mailbox if mailbox is not None else FreshestMailbox()
        stop = threading.Event()
        thread = CaptureThread(source, mailbox, stop)
        started.append((thread, stop))
        thread.start()
        return thread, mailbox

    yield start
    for thread, stop in started:
        stop.set()
        thread.join(10)
        assert not thread.is_alive()


def test_synthetic_camera_draws_its_scene_once(monkeypatch: pytest.MonkeyPatch, run_capture: Any) -> None:
    draws = []
    real_put_text = cv2.putText
    monkeypatch.setattr(
        "agent.sources.synthetic.cv2.putText", lambda *a, **k: draws.append(1) or real_put_text(*a, **k)
    )
    config = SyntheticConfig(name="lobby", fps=400, lines=3, seed=5)
    source = SyntheticSource(config)
    thread, mailbox = run_capture(source)
    consumer = SlowConsumer(thread, mailbox)
    consumer.take(CONSUMED)

    assert thread.stats.frames >= CONSUMED * CAMERA_FRAMES_PER_TAKE
    assert source.scene.renders == 1 and len(draws) == config.lines  # drawn at start, never per frame
    reference = SyntheticScene(config)
    for frame, image in consumer.taken:  # each frame shows what its index says, read-only
        assert np.array_equal(image, reference.render(frame.index - 1))
        assert not image.flags.writeable
    stamps = [frame.captured_at for frame, _ in consumer.taken]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    assert [f.index for f, _ in consumer.taken] == sorted({f.index for f, _ in consumer.taken})


def test_synthetic_frames_move_and_match_the_truth_boxes() -> None:
    scene = SyntheticScene(SyntheticConfig(seed=2, lines=2))
    first, later = scene.frame(0), scene.frame(40)
    assert first.shape == (480, 640, 3) and not np.array_equal(first, later)
    for index in (0, 40):
        image = scene.render(index)
        for line in scene.truth(index):
            x1, y1, x2, y2 = line.box
            ink = image[y1:y2, x1:x2].min(axis=2)
            assert ink.min() < 80, f"no dark text inside the truth box of {line.text!r} in frame {index}"


def test_video_decodes_only_the_frames_the_consumer_takes(tmp_path: Path, run_capture: Any) -> None:
    video = write_numbered_video(tmp_path / "clip.avi")
    source = CountingFileSource(FileConfig(name="dock", path=video, loop=True, fps=300))
    thread, mailbox = run_capture(source)
    consumer = SlowConsumer(thread, mailbox)
    consumer.take(CONSUMED)
    thread.stop_event.set()
    thread.join(10)

    captured = thread.stats.frames
    assert captured >= CONSUMED * CAMERA_FRAMES_PER_TAKE
    assert source.count("read") == 0
    assert source.count("grab") >= captured  # every frame is grabbed (plus the ends of loop passes)
    assert source.decodes() == CONSUMED  # ... but only the taken ones are converted
    assert thread.grabber is not None and thread.grabber.decoded == CONSUMED
    for frame, image in consumer.taken:  # a lazy frame shows the frame its index names
        assert decode_index(image) == (frame.index - 1) % VIDEO_FRAMES
    left = 1 if mailbox.peek() is not None else 0
    assert mailbox.dropped > 0 and mailbox.dropped + mailbox.delivered + left == captured  # drops still counted


def test_a_frame_taken_before_the_next_grab_shows_the_newer_frame(tmp_path: Path) -> None:
    video = write_numbered_video(tmp_path / "clip.avi")
    source = CountingFileSource(FileConfig(path=video))
    source.open()
    mailbox = RecordingMailbox()
    grabber = LazyGrabber(source, mailbox, "dock")
    assert grabber.grab_and_put(1)
    taken = mailbox.take()
    assert isinstance(taken, LazyFrame) and not taken.loaded
    assert grabber.grab_and_put(2)  # the capture thread moved on before the consumer used its frame
    newer = mailbox.peek()
    assert newer is not None

    assert decode_index(taken.image) == 1  # the pixels of the last grab ...
    assert taken.index == 2 and taken.captured_at == newer.captured_at  # ... with that frame's index and time
    assert mailbox.peek() is None  # served once: not again from the mailbox
    assert (mailbox.delivered, mailbox.dropped) == (1, 1)  # the older pixels count as dropped
    assert mailbox.only_counted_up()  # ... counted once, under the mailbox's lock, never undone
    assert source.decodes() == 1
    grabber.close()


def test_counts_add_up_while_a_consumer_races_the_capture_thread(tmp_path: Path, run_capture: Any) -> None:
    """Every grabbed frame is delivered once, dropped once or still waiting; no counter ever goes down."""
    video = write_numbered_video(tmp_path / "clip.avi")
    source = CountingFileSource(FileConfig(name="dock", path=video, loop=True, fps=300))
    thread, mailbox = run_capture(source, RecordingMailbox())
    served: list[tuple[int, Frame, np.ndarray]] = []
    for i in range(2 * CONSUMED):
        frame = mailbox.get(timeout=10)
        assert frame is not None
        taken_index = frame.index
        if i % 2:  # let the capture thread grab again first: the frame is served as that newer one
            assert wait_for(lambda: thread.stats.frames > taken_index, timeout=30)
        served.append((taken_index, frame, frame.image))  # else: the race is left to the scheduler
    thread.stop_event.set()
    thread.join(10)

    grabber = thread.grabber
    assert grabber is not None and grabber.grabbed == thread.stats.frames
    left = 1 if mailbox.peek() is not None else 0
    assert mailbox.delivered + mailbox.dropped + left == grabber.grabbed
    assert mailbox.delivered == len(served) == grabber.decoded == source.decodes()
    assert sum(frame.index > taken for taken, frame, _ in served) >= CONSUMED  # the newer-frame path ran
    indices = [frame.index for _, frame, _ in served]
    assert indices == sorted(set(indices))  # no frame served twice, none served older than it claims
    for _, frame, image in served:
        assert decode_index(image) == (frame.index - 1) % VIDEO_FRAMES
    assert mailbox.only_counted_up()


def test_a_frame_used_after_its_source_closed_is_a_bad_frame(tmp_path: Path) -> None:
    source = FileSource(FileConfig(path=write_numbered_video(tmp_path / "clip.avi")))
    source.open()
    mailbox: FreshestMailbox[Frame] = FreshestMailbox()
    thread = CaptureThread(source, mailbox, threading.Event())
    assert thread.grabber is not None and thread.grabber.grab_and_put(1)
    frame = mailbox.take()
    thread.grabber.close()  # the camera was lost and closed while the frame waited in a batch
    with pytest.raises(SourceError) as err:
        _ = frame.image
    assert err.value.code == "CAMERA_BAD_FRAME" and "closed" in str(err.value)
    assert thread.stats.bad_frames == 0  # not a frame the camera delivered broken


def test_image_folder_frames_are_grabbed_lazily_with_broken_files_skipped(tmp_path: Path, run_capture: Any) -> None:
    for i in range(4):
        cv2.imwrite(str(tmp_path / f"f_{i:03d}.png"), np.full((40, 40, 3), 10 + 12 * i, np.uint8))
    (tmp_path / "f_002.png").write_bytes(b"not a png")
    thread, mailbox = run_capture(FileSource(FileConfig(path=tmp_path, loop=True, fps=300)))
    consumer = SlowConsumer(thread, mailbox)
    consumer.take(4)
    assert all(isinstance(frame, LazyFrame) for frame, _ in consumer.taken)
    assert {decode_index(image) for _, image in consumer.taken} <= {0, 1, 3}


@pytest.mark.parametrize("kind", ["video", "folder"])
def test_the_last_frame_of_a_finite_input_survives_the_end(tmp_path: Path, kind: str) -> None:
    if kind == "video":
        path = write_numbered_video(tmp_path / "clip.avi", frames=5)
    else:
        path = tmp_path / "frames"
        path.mkdir()
        for i in range(5):
            cv2.imwrite(str(path / f"{i:03d}.png"), np.full((40, 40, 3), 10 + 12 * i, np.uint8))
    mailbox: FreshestMailbox[Frame] = FreshestMailbox()
    stop = threading.Event()
    thread = CaptureThread(FileSource(FileConfig(path=path, fps=500)), mailbox, stop)
    thread.start()
    assert wait_for(lambda: not thread.is_alive(), timeout=30)  # played to the end and closed its source
    last = mailbox.get(timeout=1)  # the consumer comes late: the last frame still waits, and still decodes
    assert thread.stats.ended and last is not None and last.index == 5
    assert decode_index(last.image) == 4
