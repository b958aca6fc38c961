"""Video out (agent.video) on a real agent: MJPEG over real HTTP, the H.264 stream through ffmpeg, snapshots over a
real broker, and the seed's scenario — an image-to-image model's frames streamed with glass-to-glass latency.

Real parts: the agent's own frame path on the bundled PP-OCRv4 detector (our choice), real ONNX Runtime, a real
HTTP client on loopback, real ffmpeg, a real Mosquitto, Debian's headless Chromium. The image-to-image model is an
onnx.helper filter (tests/image_models.py): no pretrained one ships in a package. The overlays themselves, the
config and the tap: test_video_overlay.py.
"""

from __future__ import annotations

import http.client
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

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from agent.video.config import VideoConfig
from agent.video.encode import JpegEncoder
from agent.video.snapshot_wire import parse_snapshot
from agent.video.stream import EncodedStream, choose_encoder, ffmpeg_command, gstreamer_command
from agent.video.tap import FrameTap
from kernel.errors import EdgeError
from engines.postprocess.base import InferenceResult
from tests.helpers import wait_for
from tests.image_models import beauty_model_dir


REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    video = {"enabled": True, "listen": f"{opts.get('host', '127.0.0.1')}:{port}", "max_fps": 10,
             **opts.get("video", {})}
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
    assert choose_encoder("auto", lambda n: "/usr/bin/ffmpeg" if n == "ffmpeg" else None,
                          lambda e: False) == ("ffmpeg", False)
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
        reply = send_command(mqtt_broker.url, "snap-01", "snapshot", {"overlay": True}, timeout_s=30,
                             command_id="snap-a")
        assert reply["ok"], reply
        meta = reply["result"]
        assert meta["topic"] == "edge/snap-01/snapshot/cam0"
        assert meta["bytes"] <= 8000 and meta["request_id"] == "snap-a"
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
    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache",
                      model={"path": model_dir, "warmup_runs": 1},
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
    expected = (np.clip(session.run(None, {"x": rgb})[0][0], 0, 1) * 255).astype(np.uint8)
    expected = expected.transpose(1, 2, 0)[:, :, ::-1]
    for _, data in parts:
        shown = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert np.abs(shown.astype(int) - expected).mean() < 3.0, "the stream shows the model's output frame"
        assert np.abs(shown.astype(int) - still).mean() > 6.0, "...not the camera's frame"
    g2g = summary["video"]["http"]["glass_to_glass_ms"]["cam0"]
    assert 0 < g2g["p50"] <= g2g["p99"]
    from agent.video.summary import video_rows
    assert any(key == "glass-to-glass cam0" and "p99" in value for key, value in video_rows(summary["video"]))


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
