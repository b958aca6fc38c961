"""Camera sources on real files, real device nodes and the real OpenCV build: no mocks."""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from typing import Iterator

import cv2
import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from agent.sources import SOURCES, create_source, source_config_models
from agent.sources.base import SourceError
from agent.sources.file import FileConfig, FileSource
from agent.sources.gstreamer import GStreamerConfig, gstreamer_supported
from agent.sources.opencv_capture import redact, to_bgr
from agent.sources.url import FFMPEG_OPTIONS_ENV, UrlConfig, ffmpeg_capture_options
from agent.sources.v4l2 import V4l2Config

VIDEO_FRAMES = 20
VIDEO_FPS = 20.0
SECRET = "hunter2"


def frame_level(i: int) -> int:
    """Gray level that encodes frame `i`; 12 levels apart survive MJPEG compression."""
    return 10 + 12 * i


def numbered_image(i: int, width: int = 160, height: int = 120) -> np.ndarray:
    """A frame whose flat background encodes `i`, with `i` drawn in for a human looking at it."""
    image = np.full((height, width, 3), frame_level(i), np.uint8)
    cv2.putText(image, str(i), (width // 2 - 20, height - 20), cv2.FONT_HERSHEY_SIMPLEX, 1.5, (255, 255, 255), 3)
    return image


def decode_index(image: np.ndarray) -> int:
    """Frame number back from the top-left patch (no text there)."""
    return round((float(image[:24, :24].mean()) - 10) / 12)


def write_numbered_video(path: Path, frames: int = VIDEO_FRAMES, fps: float = VIDEO_FPS) -> Path:
    """A real MJPG .avi made with cv2.VideoWriter, frame i showing i."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (160, 120))
    assert writer.isOpened(), "this OpenCV cannot write MJPG .avi"
    for i in range(frames):
        writer.write(numbered_image(i))
    writer.release()
    return path


@pytest.fixture
def video(tmp_path: Path) -> Path:
    return write_numbered_video(tmp_path / "clip.avi")


def read_indices(source: FileSource, count: int) -> list[int]:
    out = []
    for _ in range(count):
        image = source.read()
        assert image is not None
        assert image.dtype == np.uint8 and image.shape == (120, 160, 3)
        out.append(decode_index(image))
    return out


# --- registry -------------------------------------------------------------------------------------


def test_every_source_is_registered_with_a_described_strict_config() -> None:
    assert {"synthetic", "file", "v4l2", "url", "gstreamer"} <= set(SOURCES.names())
    assert {FileConfig, V4l2Config, UrlConfig, GStreamerConfig} <= set(source_config_models())
    for model in (FileConfig, V4l2Config, UrlConfig, GStreamerConfig):
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


# --- file: video ----------------------------------------------------------------------------------


def test_video_file_reads_every_frame_in_order_then_ends(video: Path) -> None:
    source = create_source(FileConfig(path=video))
    source.open()
    try:
        assert source.paced
        assert source.frame_interval_s() == pytest.approx(1 / VIDEO_FPS)
        assert read_indices(source, VIDEO_FRAMES) == list(range(VIDEO_FRAMES))
        assert source.read() is None
    finally:
        source.close()
        source.close()


def test_video_file_loop_wraps_around(video: Path) -> None:
    source = FileSource(FileConfig(path=video, loop=True, fps=50))
    source.open()
    try:
        assert source.frame_interval_s() == pytest.approx(1 / 50)
        indices = read_indices(source, 2 * VIDEO_FRAMES + 3)
    finally:
        source.close()
    assert indices == list(range(VIDEO_FRAMES)) * 2 + [0, 1, 2]


def test_reopen_starts_the_video_again(video: Path) -> None:
    source = FileSource(FileConfig(path=video))
    source.open()
    read_indices(source, 5)
    source.open()
    try:
        assert read_indices(source, 2) == [0, 1]
    finally:
        source.close()


def test_file_that_is_not_a_video_says_what_to_check(tmp_path: Path) -> None:
    bogus = tmp_path / "notes.mp4"
    bogus.write_text("not a video\n")
    source = FileSource(FileConfig(path=bogus))
    with pytest.raises(SourceError, match="notes.mp4"):
        source.open()
        source.read()  # some backends open anything and fail on the first frame
    source.close()


def test_missing_file_error_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "clip.mp4"
    with pytest.raises(SourceError, match=f"{missing}: no such file or folder"):
        FileSource(FileConfig(path=missing)).open()


def test_read_before_open_is_a_source_error(video: Path) -> None:
    with pytest.raises(SourceError, match="before open"):
        FileSource(FileConfig(path=video)).read()


# --- file: image folder ---------------------------------------------------------------------------


def test_image_folder_sorted_skips_unreadable_and_converts_to_bgr(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cv2.imwrite(str(tmp_path / "f_000.png"), numbered_image(0))
    cv2.imwrite(str(tmp_path / "f_001.png"), cv2.cvtColor(numbered_image(1), cv2.COLOR_BGR2GRAY))  # 1 channel
    (tmp_path / "f_002.jpg").write_bytes(b"\xff\xd8 truncated, not a jpeg")
    cv2.imwrite(str(tmp_path / "f_003.bmp"), numbered_image(3))
    cv2.imwrite(str(tmp_path / "f_004.png"), cv2.cvtColor(numbered_image(4), cv2.COLOR_BGR2BGRA))  # 4 channels
    (tmp_path / "readme.txt").write_text("ignored: not an image suffix\n")

    source = FileSource(FileConfig(path=tmp_path, loop=True))
    source.open()
    with caplog.at_level(logging.WARNING, logger="agent.sources.file"):
        first_pass = read_indices(source, 4)
        second_pass = read_indices(source, 4)
    source.close()

    assert first_pass == second_pass == [0, 1, 3, 4]
    assert source.skipped == 2  # the broken file, once per pass
    warnings = [r.getMessage() for r in caplog.records if "f_002.jpg" in r.getMessage()]
    assert len(warnings) == 1 and "1 skipped so far" in warnings[0]
    assert source.frame_interval_s() == pytest.approx(1 / 30)


def test_image_folder_without_loop_ends(tmp_path: Path) -> None:
    for i in range(3):
        cv2.imwrite(str(tmp_path / f"img_{i:04d}.jpg"), numbered_image(i))
    source = FileSource(FileConfig(path=tmp_path))
    source.open()
    assert read_indices(source, 3) == [0, 1, 2]
    assert source.read() is None


def test_folder_without_images_or_with_only_broken_ones(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no .* images in this folder"):
        FileSource(FileConfig(path=tmp_path)).open()
    (tmp_path / "a.png").write_bytes(b"junk")
    source = FileSource(FileConfig(path=tmp_path, loop=True))
    source.open()
    with pytest.raises(SourceError, match="no readable frames"):
        source.read()  # a loop over nothing must fail, not spin


@pytest.mark.parametrize(
    ("image", "shape"),
    [
        (np.zeros((10, 12), np.uint8), (10, 12, 3)),
        (np.zeros((10, 12, 1), np.uint8), (10, 12, 3)),
        (np.zeros((10, 12, 4), np.uint8), (10, 12, 3)),
        (np.zeros((10, 12, 3), np.uint8), (10, 12, 3)),
    ],
)
def test_to_bgr_gives_three_channels(image: np.ndarray, shape: tuple[int, ...]) -> None:
    assert to_bgr(image).shape == shape


# --- v4l2 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["/dev/video9", 9])
def test_v4l2_missing_device_says_so(device: int | str) -> None:
    """Stands in for an unplugged USB camera or a wrong camera.device: no camera exists on CI."""
    if os.path.exists("/dev/video9"):
        pytest.skip("this machine has a /dev/video9")
    source = create_source(V4l2Config(device=device))
    with pytest.raises(SourceError, match=r"^/dev/video9: no such device; check the camera is plugged in"):
        source.open()
    source.close()


def test_v4l2_node_that_is_not_a_camera_is_refused_by_opencv() -> None:
    """/dev/null stands in for a node that exists but is no capture device (a metadata node such as
    /dev/video1 of a UVC camera): the real OpenCV V4L2 backend refuses it."""
    source = create_source(V4l2Config(device="/dev/null", width=640, height=480, fourcc="MJPG"))
    with pytest.raises(SourceError, match=r"^/dev/null: could not open; not a V4L2 capture device"):
        source.open()
    source.close()


# --- gstreamer ------------------------------------------------------------------------------------


@pytest.mark.skipif(gstreamer_supported(cv2.getBuildInformation()), reason="this OpenCV has GStreamer")
def test_gstreamer_refused_by_this_opencv_build() -> None:
    config = GStreamerConfig(pipeline="videotestsrc num-buffers=10 ! videoconvert ! appsink")
    with pytest.raises(SourceError, match="built without GStreamer") as caught:
        create_source(config)
    assert caught.value.code == "CAMERA_UNSUPPORTED"
    assert "python3-opencv" in str(caught.value) and "--system-site-packages" in str(caught.value)


def test_gstreamer_build_information_parsing() -> None:
    jetpack = "  Video I/O:\n    FFMPEG:   YES\n    GStreamer:                   YES (1.20.3)\n"
    pip_wheel = "  Video I/O:\n    FFMPEG:   YES\n    GStreamer:                   NO\n"
    assert gstreamer_supported(jetpack)
    assert not gstreamer_supported(pip_wheel)


# --- url ------------------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_url_open_failure_is_actionable_and_hides_the_password(caplog: pytest.LogCaptureFixture) -> None:
    url = f"tcp://admin:{SECRET}@127.0.0.1:{closed_port()}"
    source = create_source(UrlConfig(url=url, open_timeout_ms=2000))
    with caplog.at_level(logging.DEBUG), pytest.raises(SourceError) as caught:
        source.open()
    source.close()
    message = str(caught.value)
    assert "tcp://***@127.0.0.1" in message and "check the host answers (ping)" in message
    assert SECRET not in message
    assert all(SECRET not in r.getMessage() for r in caplog.records)
    assert SECRET not in repr(source.config)


@pytest.mark.parametrize(("transport", "other"), [(None, "udp"), ("tcp", "udp"), ("udp", "tcp")])
def test_rtsp_open_hint_suggests_the_other_transport(transport: str | None, other: str) -> None:
    config = UrlConfig(url=f"rtsp://127.0.0.1:{closed_port()}/stream1", transport=transport, open_timeout_ms=2000)
    with pytest.raises(SourceError, match=f'try transport = "{other}"'):
        create_source(config).open()


class RtspHandshakeRecorder:
    """A real RTSP server on loopback that answers OPTIONS and DESCRIBE, refuses SETUP (461) and records the
    SETUP `Transport:` header FFmpeg sent: enough to see which transport OpenCV's FFmpeg asked for."""

    SDP = "v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=t\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\nm=video 0 RTP/AVP 96\r\n"
    SDP += "a=rtpmap:96 H264/90000\r\na=control:track1\r\n"

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(10)
        self.port = self.sock.getsockname()[1]
        self.transports: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by the fixture
                return
            with conn:
                self._session(conn)

    def _session(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        buffer = b""
        while data := conn.recv(4096):
            buffer += data
            while b"\r\n\r\n" in buffer:
                request, buffer = buffer.split(b"\r\n\r\n", 1)
                conn.sendall(self._answer(request.decode().split("\r\n")).encode())

    def _answer(self, lines: list[str]) -> str:
        headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
        cseq = headers.get("CSeq", "0").strip()
        method = lines[0].split()[0]
        if method == "OPTIONS":
            return f"RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nPublic: DESCRIBE, SETUP, PLAY, TEARDOWN\r\n\r\n"
        if method == "DESCRIBE":
            return (
                f"RTSP/1.0 200 OK\r\nCSeq: {cseq}\r\nContent-Type: application/sdp\r\n"
                f"Content-Length: {len(self.SDP)}\r\n\r\n{self.SDP}"
            )
        self.transports.append(headers.get("Transport", "").strip())
        return f"RTSP/1.0 461 Unsupported Transport\r\nCSeq: {cseq}\r\n\r\n"

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        self.sock.close()
        self.thread.join(timeout=10)


@pytest.fixture
def rtsp_recorder() -> Iterator[RtspHandshakeRecorder]:
    recorder = RtspHandshakeRecorder()
    try:
        yield recorder
    finally:
        recorder.close()


def test_rtsp_transport_reaches_ffmpeg_and_does_not_leak(rtsp_recorder: RtspHandshakeRecorder) -> None:
    url = f"rtsp://admin:{SECRET}@127.0.0.1:{rtsp_recorder.port}/stream1"
    setups = {}
    for transport in ("udp", None, "tcp"):
        rtsp_recorder.transports.clear()
        source = create_source(UrlConfig(url=url, transport=transport, open_timeout_ms=5000))
        with pytest.raises(SourceError, match="could not open") as caught:
            source.open()  # the recorder refuses SETUP: the open fails after the transport was chosen
        assert SECRET not in str(caught.value)
        setups[transport] = list(rtsp_recorder.transports)
    assert setups["udp"] and all(t.startswith("RTP/AVP/UDP;unicast") for t in setups["udp"])
    assert setups["tcp"] and all(t.startswith("RTP/AVP/TCP") for t in setups["tcp"])
    # OpenCV's own default is TCP first (FFmpeg then falls back on 461), so udp did not leak into this open.
    assert setups[None][0].startswith("RTP/AVP/TCP") and len(setups[None]) > 1
    assert FFMPEG_OPTIONS_ENV not in os.environ


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("rtsp://admin:hunter2@10.0.0.5:554/s1", "rtsp://***@10.0.0.5:554/s1"),
        ("rtsp://admin:hun@ter2@cam/s1", "rtsp://***@cam/s1"),
        ("http://tokenhunter2@cam/mjpg", "http://***@cam/mjpg"),
        (
            "rtspsrc location=rtsp://u:hunter2@cam/x latency=0 ! appsink",
            "rtspsrc location=rtsp://***@cam/x latency=0 ! appsink",
        ),
        ("udp://239.0.0.1:5000", "udp://239.0.0.1:5000"),
        ("http://cam/a@b", "http://***@b")  # an @ after :// may end a password: hidden,
    ],
)
def test_redact(text: str, shown: str) -> None:
    assert redact(text) == shown


def test_ffmpeg_options_keep_the_operators_and_are_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FFMPEG_OPTIONS_ENV, "stimeout;5000000")
    with ffmpeg_capture_options("rtsp_transport;tcp"):
        assert os.environ[FFMPEG_OPTIONS_ENV] == "stimeout;5000000|rtsp_transport;tcp"
    assert os.environ[FFMPEG_OPTIONS_ENV] == "stimeout;5000000"
    monkeypatch.delenv(FFMPEG_OPTIONS_ENV)
    with ffmpeg_capture_options("rtsp_transport;udp"):
        assert os.environ[FFMPEG_OPTIONS_ENV] == "rtsp_transport;udp"
    assert FFMPEG_OPTIONS_ENV not in os.environ


# --- config validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "fields", "bad_field"),
    [
        (FileConfig, {"path": "x.mp4", "lop": True}, "lop"),
        (FileConfig, {"path": "x.mp4", "loop": "sometimes"}, "loop"),
        (FileConfig, {"path": "x.mp4", "fps": 0}, "fps"),
        (V4l2Config, {"device": 0, "resolution": "720p"}, "resolution"),
        (V4l2Config, {"width": "wide"}, "width"),
        (V4l2Config, {"fourcc": "MJPEG"}, "fourcc"),
        (V4l2Config, {"device": "video0"}, "device"),
        (UrlConfig, {"url": "rtsp://cam/s", "timeout": 5}, "timeout"),
        (UrlConfig, {"url": "rtsp://cam/s", "open_timeout_ms": "soon"}, "open_timeout_ms"),
        (UrlConfig, {"url": "rtsp://cam/s", "transport": "quic"}, "transport"),
        (UrlConfig, {"url": "http://cam/mjpg", "transport": "tcp"}, "transport"),
        (UrlConfig, {"url": "ftp://cam/s"}, "url"),
        (GStreamerConfig, {"pipeline": "videotestsrc ! autovideosink"}, "pipeline"),
        (GStreamerConfig, {"pipeline": "videotestsrc ! appsink", "sync": False}, "sync"),
    ],
)
def test_config_errors_name_the_field(model: type[BaseModel], fields: dict, bad_field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        model(**fields)
    assert [e["loc"] for e in caught.value.errors()] == [(bad_field,)]


@pytest.mark.parametrize(
    ("model", "bad"),
    [
        (UrlConfig, {"url": f"ftp://admin:{SECRET}@cam/s"}),
        (UrlConfig, {"url": f"rtsp://admin:{SECRET}@cam/s", "read_timeout_ms": 1}),
        (UrlConfig, {"url": f"http://admin:{SECRET}@cam/s", "transport": "tcp"}),
        (GStreamerConfig, {"pipeline": f"rtspsrc location=rtsp://admin:{SECRET}@cam/s ! fakesink"}),
    ],
)
def test_passwords_stay_out_of_validation_errors_and_reprs(model: type[BaseModel], bad: dict) -> None:
    class Agent(BaseModel):
        camera: model

    with pytest.raises(ValidationError) as direct:
        model(**bad)
    with pytest.raises(ValidationError) as nested:
        Agent(camera=bad)
    assert SECRET not in str(direct.value) and SECRET not in str(nested.value)
    good = (
        {"url": f"rtsp://admin:{SECRET}@cam/s"} if model is UrlConfig else {"pipeline": f"{bad['pipeline']} ! appsink"}
    )
    assert SECRET not in repr(model(**good))
