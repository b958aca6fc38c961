"""`[video.stream]`: one camera as H.264 through an encoder process that reads raw BGR frames on its stdin.

On a Jetson that is GStreamer with the hardware encoder (`nvv4l2h264enc`); elsewhere ffmpeg with libx264, or
GStreamer with x264enc. The process is the whole encoder and muxer: RTSP (push to a server such as MediaMTX),
MPEG-TS over UDP/TCP, or a file. A missing encoder is a clear error in the status and an event; the MJPEG
server and the frame path do not depend on it. The writer thread blocks on the pipe when the encoder is
slow; the frame path never does (the tap keeps only the newest frame).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np

from agent.redact import redact
from agent.video.config import StreamConfig
from agent.video.encode import JpegEncoder, fit_width
from agent.video.tap import FrameTap
from engines.errors import EdgeError

log = logging.getLogger(__name__)

_FILE_FORMATS = {".ts": "mpegts", ".mp4": "mp4", ".mkv": "matroska", ".flv": "flv", ".h264": "h264"}


def _which(name: str) -> str | None:
    return shutil.which(name)


def gst_has(element: str, which: Callable[[str], str | None] = _which) -> bool:
    """True when GStreamer's `element` is installed (gst-inspect-1.0 finds it)."""
    inspect = which("gst-inspect-1.0")
    if inspect is None:
        return False
    try:
        return subprocess.run([inspect, "--exists", element], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def choose_encoder(kind: str, which: Callable[[str], str | None] = _which,
                   has_element: Callable[[str], bool] = gst_has) -> tuple[str, bool]:
    """(encoder, hardware) for `[video.stream] encoder`; EdgeError VIDEO_ENCODER_MISSING naming what is missing."""
    if kind in ("auto", "gstreamer") and which("gst-launch-1.0") and has_element("nvv4l2h264enc"):
        return "gstreamer", True
    if kind in ("auto", "ffmpeg") and which("ffmpeg"):
        return "ffmpeg", False
    if kind in ("auto", "gstreamer") and which("gst-launch-1.0") and has_element("x264enc"):
        return "gstreamer", False
    wanted = {"auto": "gst-launch-1.0 (with nvv4l2h264enc or x264enc) or ffmpeg",
              "gstreamer": "gst-launch-1.0 with nvv4l2h264enc or x264enc", "ffmpeg": "ffmpeg"}[kind]
    raise EdgeError(f"video.stream: no encoder found ({wanted} is not installed); the MJPEG server is not affected. "
                    "Install ffmpeg or GStreamer's plugins, or set video.stream.url = \"\"", code="VIDEO_ENCODER_MISSING")


def ffmpeg_command(url: str, width: int, height: int, cfg: StreamConfig) -> list[str]:
    """ffmpeg reading raw BGR frames on stdin, writing H.264 to `url` (the muxer from its scheme or suffix)."""
    fps = f"{cfg.fps:g}"
    argv = ["ffmpeg", "-hide_banner", "-loglevel", "error", "-nostdin", "-y", "-f", "rawvideo", "-pix_fmt", "bgr24",
            "-video_size", f"{width}x{height}", "-framerate", fps, "-i", "pipe:0", "-an", "-c:v", "libx264",
            "-preset", "ultrafast", "-tune", "zerolatency", "-pix_fmt", "yuv420p", "-b:v", f"{cfg.bitrate_kbps}k",
            "-g", str(max(1, round(cfg.fps * 2)))]
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in ("rtsp", "rtsps"):
        argv += ["-f", "rtsp", "-rtsp_transport", "tcp"]
    elif scheme in ("udp", "tcp", "srt", "rtp"):
        argv += ["-f", "rtp" if scheme == "rtp" else "mpegts"]
    elif scheme == "":
        argv += ["-f", _FILE_FORMATS.get(Path(url).suffix.lower(), "mpegts")]
    else:
        raise EdgeError(f"video.stream.url: unsupported scheme {scheme!r} (rtsp://, udp://, tcp://, srt://, rtp:// or a "
                        "file path)", code="CONFIG_INVALID")
    return argv + [url]


def gstreamer_command(url: str, width: int, height: int, cfg: StreamConfig, hardware: bool) -> list[str]:
    """gst-launch-1.0 reading raw BGR frames on stdin; nvv4l2h264enc on a Jetson, x264enc elsewhere."""
    fps = max(1, round(cfg.fps))
    source = (f"fdsrc fd=0 do-timestamp=true ! rawvideoparse width={width} height={height} format=bgr "
              f"framerate={fps}/1 ! videoconvert")
    if hardware:
        encode = (f"nvvidconv ! video/x-raw(memory:NVMM),format=NV12 ! nvv4l2h264enc bitrate={cfg.bitrate_kbps * 1000} "
                  f"insert-sps-pps=true iframeinterval={fps * 2} ! h264parse")
    else:
        encode = (f"video/x-raw,format=I420 ! x264enc tune=zerolatency speed-preset=ultrafast bitrate={cfg.bitrate_kbps} "
                  f"key-int-max={fps * 2} ! h264parse")
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower() if rest else ""
    if scheme in ("rtsp", "rtsps"):
        sink = f"rtspclientsink location={url} protocols=tcp"
    elif scheme in ("udp", "tcp"):
        host, _, port = rest.rstrip("/").rpartition(":")
        sink = f"mpegtsmux ! {scheme}{'sink' if scheme == 'udp' else 'clientsink'} host={host} port={port}"
    elif scheme == "":
        mux = {".mp4": "mp4mux", ".mkv": "matroskamux"}.get(Path(url).suffix.lower(), "mpegtsmux")
        sink = f"{mux} ! filesink location={url}"
    else:
        raise EdgeError(f"video.stream.url: GStreamer output supports rtsp://, udp://, tcp:// or a file, not {scheme!r}",
                        code="CONFIG_INVALID")
    return ["gst-launch-1.0", "-q", "-e", *f"{source} ! {encode} ! {sink}".split(" ")]


class EncodedStream(threading.Thread):
    """Feeds the newest frames of one camera to the encoder process at `fps`; restarts a failed one."""

    def __init__(self, cfg: StreamConfig, camera: str, tap: FrameTap, encoder: JpegEncoder,
                 on_event: Callable[..., None], stop: threading.Event, which: Callable[[str], str | None] = _which,
                 has_element: Callable[[str], bool] = gst_has) -> None:
        super().__init__(name="video-stream", daemon=True)
        self.cfg, self.camera, self.tap, self.encoder = cfg, camera, tap, encoder
        self.on_event, self.stop_event = on_event, stop
        self.which, self.has_element = which, has_element
        self.state = "starting"
        self.error: dict[str, Any] | None = None
        self.frames = 0
        self.restarts = 0
        self.encoder_name: str | None = None
        self.hardware = False
        self.size: tuple[int, int] | None = None
        self._proc: subprocess.Popen | None = None

    def status(self) -> dict[str, Any]:
        """What `status`, telemetry and the run summary show of the stream."""
        return {"url": redact(self.cfg.url), "camera": self.camera, "state": self.state, "encoder": self.encoder_name,
                "hardware": self.hardware, "frames": self.frames, "restarts": self.restarts,
                "size": list(self.size) if self.size else None, "error": self.error}

    def run(self) -> None:
        try:
            self.encoder_name, self.hardware = choose_encoder(self.cfg.encoder, self.which, self.has_element)
        except EdgeError as exc:
            self._fail(exc.code, str(exc))
            return
        seq, due, interval = 0, 0.0, 1.0 / self.cfg.fps
        with self.tap.watch(self.camera):
            while not self.stop_event.is_set():
                shot = self.tap.wait_next(self.camera, seq, 1.0)
                if shot is None:
                    continue
                wait = due - time.monotonic()
                if wait > 0:
                    if self.stop_event.wait(wait):
                        break
                    shot = self.tap.latest(self.camera) or shot
                picture = self.encoder.picture(shot, self.cfg.overlay, self.cfg.width or None)
                if not self._write(picture):
                    break
                seq, due = shot.seq, max(due + interval, time.monotonic() - interval)
        self._close()
        if self.state == "running":
            self.state = "stopped"

    def _write(self, picture: np.ndarray) -> bool:
        """One frame into the encoder (started on the first frame, restarted when it died); False: give up."""
        if self.size is None:
            height, width = picture.shape[:2]
            self.size = (width - width % 2, height - height % 2)  # x264 and NV12 need even sizes
        width, height = self.size
        if picture.shape[1] != width or picture.shape[0] != height:
            picture = cv2.resize(picture, (width, height), interpolation=cv2.INTER_AREA)
        while not self.stop_event.is_set():
            if self._proc is None or self._proc.poll() is not None:
                if not self._spawn():
                    return False
            try:
                assert self._proc is not None and self._proc.stdin is not None
                self._proc.stdin.write(np.ascontiguousarray(picture).data)
                self.frames += 1
                return True
            except (BrokenPipeError, OSError, ValueError):
                self._reap()
        return False

    def _spawn(self) -> bool:
        if self._proc is not None:  # it ended: count a restart and back off
            if self.restarts >= self.cfg.restart_max:
                self._fail("VIDEO_ENCODER_FAILED", f"the encoder ended {self.restarts + 1} time(s); last: {self.error}")
                return False
            self.restarts += 1
            if self.stop_event.wait(min(30.0, 0.5 * 2 ** self.restarts)):
                return False
        assert self.size is not None and self.encoder_name is not None
        width, height = self.size
        if self.encoder_name == "ffmpeg":
            argv = ffmpeg_command(self.cfg.url, width, height, self.cfg)
        else:
            argv = gstreamer_command(self.cfg.url, width, height, self.cfg, self.hardware)
        argv[0] = self.which(argv[0]) or argv[0]
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except OSError as exc:
            self._fail("VIDEO_ENCODER_MISSING", f"cannot start {argv[0]}: {exc}")
            return False
        self.state = "running"
        log.info("video: streaming %s to %s with %s%s", self.camera, redact(self.cfg.url), self.encoder_name,
                 " (hardware)" if self.hardware else "")
        return True

    def _reap(self) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        err = proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
        self.error = {"code": "VIDEO_ENCODER_FAILED", "message": redact(f"{self.encoder_name} exited with "
                                                                       f"{proc.returncode}: {err.strip()}")}
        log.warning("video: %s", self.error["message"])

    def _close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # end of stream: the muxer writes its trailer
            proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(5)

    def _fail(self, code: str, message: str) -> None:
        self.state = "failed"
        self.error = {"code": code, "message": redact(message)}
        log.error("video stream: %s", self.error["message"])
        self.on_event("video_stream_failed", camera=self.camera, **self.error)
