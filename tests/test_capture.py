"""CaptureThread with real sources: a video file, a misbehaving driver, and a stream server that dies."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import numpy as np
import pytest

from agent.pipeline.capture import CaptureThread
from agent.pipeline.mailbox import FreshestMailbox
from agent.sources import create_source
from agent.sources.base import Frame, SourceConfigBase
from agent.sources.file import FileConfig
from agent.sources.url import UrlConfig
from tests.test_sources import decode_index, write_numbered_video

DEADLINE_S = 15.0  # generous: these waits poll and return as soon as the condition holds


def wait_for(condition: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    """Poll `condition` until true; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


class Events:
    """Collects on_event calls from the capture thread."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, type_: str, **fields: Any) -> None:
        self.items.append((type_, fields))

    def types(self) -> list[str]:
        return [t for t, _ in self.items]


class Capture:
    """A started CaptureThread with its mailbox and events; stopped by the fixture."""

    def __init__(self, source: Any) -> None:
        self.mailbox: FreshestMailbox[Frame] = FreshestMailbox()
        self.stop = threading.Event()
        self.events = Events()
        self.thread = CaptureThread(source, self.mailbox, self.stop, self.events)
        self.thread.start()

    def shutdown(self) -> None:
        self.stop.set()
        self.mailbox.close()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "capture thread did not stop"


@pytest.fixture
def start_capture() -> Iterator[Callable[[Any], Capture]]:
    started: list[Capture] = []

    def start(source: Any) -> Capture:
        started.append(Capture(source))
        return started[-1]

    yield start
    for capture in started:
        capture.shutdown()


def test_file_source_frames_reach_the_mailbox(tmp_path: Path, start_capture: Callable[[Any], Capture]) -> None:
    video = write_numbered_video(tmp_path / "clip.avi")
    capture = start_capture(create_source(FileConfig(name="door", path=video, loop=True, fps=200)))
    wait_for(lambda: capture.thread.stats.frames >= 30, "30 frames (the 20-frame clip looped)")
    frame = capture.mailbox.get(timeout=5)
    assert frame is not None and frame.source == "door"
    assert frame.image.dtype == np.uint8 and frame.image.shape == (120, 160, 3)
    assert 0 <= decode_index(frame.image) < 20
    assert 0 < frame.captured_at <= time.monotonic()
    later = capture.mailbox.get(timeout=5)
    assert later is not None and later.index > frame.index and later.captured_at >= frame.captured_at
    assert capture.events.items == [] and capture.thread.stats.losses == 0


def test_missing_file_is_reported_once_and_retried(tmp_path: Path, start_capture: Callable[[Any], Capture]) -> None:
    missing = tmp_path / "clip.avi"
    capture = start_capture(create_source(FileConfig(path=missing, reopen_initial_s=0.05, reopen_max_s=0.1)))
    wait_for(lambda: capture.thread.stats.reopen_attempts >= 3, "three open attempts")
    assert capture.events.types() == ["camera_lost"]
    assert str(missing) in capture.events.items[0][1]["reason"]
    write_numbered_video(missing)  # the file appears: the next reopen succeeds
    wait_for(lambda: "camera_recovered" in capture.events.types(), "camera_recovered")
    wait_for(lambda: capture.thread.stats.frames > 0, "frames after recovery")


class MisbehavingSource:
    """Test-only source standing in for a broken driver: every third frame is float32, the rest are fine."""

    Config: ClassVar[type[SourceConfigBase]] = SourceConfigBase
    paced: ClassVar[bool] = True

    def __init__(self) -> None:
        self.config = SourceConfigBase(name="flaky")
        self.reads = 0

    def open(self) -> None:
        """Nothing to open."""

    def read(self) -> np.ndarray:
        """A good BGR frame, or a float32 one the capture thread must reject."""
        self.reads += 1
        image = np.full((32, 32, 3), 128, np.uint8)
        return image.astype(np.float32) if self.reads % 3 == 0 else image

    def close(self) -> None:
        """Nothing to release."""

    def frame_interval_s(self) -> float:
        """Fast, to keep the test short."""
        return 0.002


def test_bad_frames_are_counted_without_stopping_capture(start_capture: Callable[[Any], Capture]) -> None:
    capture = start_capture(MisbehavingSource())
    wait_for(lambda: capture.thread.stats.bad_frames >= 5 and capture.thread.stats.frames >= 10, "good and bad frames")
    assert capture.thread.is_alive()
    frame = capture.mailbox.get(timeout=5)
    assert frame is not None and frame.image.dtype == np.uint8
    assert capture.events.items == [] and capture.thread.stats.losses == 0


# --- a real stream server that goes away and comes back ----------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port`, read from /proc so the one-client server is not used up."""
    wanted = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as table:
        return any(line.split()[1] == wanted and line.split()[3] == "0A" for line in table.readlines()[1:])


class StreamServer:
    """ffmpeg serving an endless MPEG-TS test pattern to one TCP client at a time."""

    def __init__(self, port: int, log_path: Path) -> None:
        self.port = port
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # mpeg2video needs a standard rate (15 fps is refused); -g 5 lets a new client decode within 0.2 s.
        command = [
            "ffmpeg", "-hide_banner", "-nostdin", "-loglevel", "error", "-re",
            "-f", "lavfi", "-i", "testsrc=size=320x240:rate=25",
            "-c:v", "mpeg2video", "-g", "5", "-f", "mpegts", "-listen", "1", f"tcp://127.0.0.1:{self.port}",
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        wait_for(lambda: listening(self.port) or self.process.poll() is not None, "ffmpeg to listen")
        assert self.process.poll() is None, f"ffmpeg exited: {self.log_path.read_text()}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


@pytest.fixture
def stream_server(tmp_path: Path) -> Iterator[StreamServer]:
    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg not installed (make system-deps)")
    server = StreamServer(free_port(), tmp_path / "ffmpeg.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_stream_lost_when_server_dies_and_recovered_when_it_returns(
    stream_server: StreamServer, start_capture: Callable[[Any], Capture]
) -> None:
    stream_server.start()
    config = UrlConfig(
        name="gate",
        url=f"tcp://127.0.0.1:{stream_server.port}",
        open_timeout_ms=5000,
        read_timeout_ms=3000,
        reopen_initial_s=0.1,
        reopen_max_s=0.4,
    )
    capture = start_capture(create_source(config))
    stats = capture.thread.stats
    wait_for(lambda: stats.frames >= 10, "frames from the stream")
    first = capture.mailbox.get(timeout=5)
    assert first is not None and first.image.shape == (240, 320, 3) and first.source == "gate"

    stream_server.stop()
    wait_for(lambda: "camera_lost" in capture.events.types(), "camera_lost after the server died")
    lost = capture.events.items[0][1]
    assert lost["camera"] == "gate" and "stream ended or no frame" in lost["reason"]
    wait_for(lambda: stats.reopen_attempts >= 3, "reopen attempts while the server is down")
    frames_while_down = stats.frames

    restarted_at = time.monotonic()
    stream_server.start()
    wait_for(lambda: "camera_recovered" in capture.events.types(), "camera_recovered after the server returned")
    wait_for(lambda: stats.frames >= frames_while_down + 10, "frames after recovery")
    assert capture.events.types() == ["camera_lost", "camera_recovered"]
    assert stats.losses == 1 and stats.recoveries == 1 and stats.connected
    resumed = capture.mailbox.get(timeout=5)
    assert resumed is not None and resumed.captured_at > restarted_at and resumed.index > first.index


def test_finite_file_source_ends_instead_of_reopening(tmp_path) -> None:
    """A file with loop=false plays once: one `camera_ended` event, no lost/recovered cycle."""
    import threading

    import cv2
    import numpy as np

    from agent.pipeline.capture import CaptureThread
    from agent.pipeline.mailbox import FreshestMailbox
    from agent.sources import create_source
    from agent.sources.file import FileConfig
    from tests.helpers import wait_for

    folder = tmp_path / "frames"
    folder.mkdir()
    for i in range(3):
        cv2.imwrite(str(folder / f"{i:03d}.png"), np.full((32, 32, 3), i * 40, np.uint8))
    events: list[str] = []
    stop = threading.Event()
    thread = CaptureThread(create_source(FileConfig(path=folder, loop=False, fps=200)), FreshestMailbox(), stop,
                           lambda kind, **_: events.append(kind))
    thread.start()
    try:
        assert wait_for(lambda: not thread.is_alive(), timeout=20)
    finally:
        stop.set()
        thread.join(5)
    assert events == ["camera_ended"] and thread.stats.frames == 3
