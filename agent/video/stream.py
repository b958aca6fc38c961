"""`[video.stream]`: one camera as H.264 through an encoder process that reads raw BGR frames on its stdin.

On a Jetson that is GStreamer with the hardware encoder (`nvv4l2h264enc`); elsewhere ffmpeg with libx264, or
GStreamer with x264enc. The process is the whole encoder and muxer: RTSP (push to a server such as MediaMTX),
MPEG-TS over UDP/TCP, or a file. A missing encoder is a clear error in the status and an event; the MJPEG
server and the frame path do not depend on it.

The encoder's input runs at a constant `fps`: every tick writes the newest picture, the same one again when
the model delivers fewer frames (the rawvideo input stamps frames by count, so a variable rate would play
too fast, and a stalled camera would make an RTSP server drop the publisher). The writer thread blocks on
the pipe when the encoder is slow; the frame path never does (the tap keeps only the newest frame).
"""

from __future__ import annotations

import collections
import logging
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np

from agent.base.redact import redact
from agent.video.config import StreamConfig, stream_target
from agent.video.encode import JpegEncoder
from agent.video.tap import FrameTap
from kernel.errors import EdgeError

log = logging.getLogger(__name__)

HEALTHY_S = 60.0  # an encoder that ran this long clears the restart count
UNLIMITED_WIDTH = 1 << 16
_FFMPEG_FILE_FORMATS = {".ts": "mpegts", ".mp4": "mp4", ".mkv": "matroska"}
_GST_FILE_MUXERS = {".ts": "mpegtsmux", ".mp4": "mp4mux", ".mkv": "matroskamux"}


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
    raise EdgeError(
        f"video.stream: no encoder found ({wanted} is not installed); the MJPEG server is not affected. "
        'Install ffmpeg or GStreamer\'s plugins, or set video.stream.url = ""',
        code="VIDEO_ENCODER_MISSING",
    )


def stream_size(width: int, height: int) -> tuple[int, int]:
    """The encoder's frame size: width a multiple of 4 (GStreamer pads BGR rows to 4 bytes; x264 and NV12 need
    even sizes), height even."""
    return max(4, width - width % 4), max(2, height - height % 2)


def ffmpeg_command(url: str, width: int, height: int, cfg: StreamConfig) -> list[str]:
    """ffmpeg reading raw BGR frames on stdin, writing H.264 to `url` (the muxer from its scheme or suffix)."""
    scheme, _ = _target(url)
    argv = ["ffmpeg", "-hide_banner", "-loglevel", "error", "-nostdin", "-y", "-f", "rawvideo", "-pix_fmt", "bgr24",
            "-video_size", f"{width}x{height}", "-framerate", f"{cfg.fps:g}", "-i", "pipe:0", "-an", "-c:v", "libx264",
            "-preset", "ultrafast", "-tune", "zerolatency", "-pix_fmt", "yuv420p", "-b:v", f"{cfg.bitrate_kbps}k",
            "-g", str(max(1, round(cfg.fps * 2)))]
    if scheme in ("rtsp", "rtsps"):
        argv += ["-f", "rtsp", "-rtsp_transport", "tcp"]
    elif scheme == "rtp":
        argv += ["-f", "rtp"]
    elif scheme:
        argv += ["-f", "mpegts"]
    else:
        argv += ["-f", _FFMPEG_FILE_FORMATS[Path(url).suffix.lower()]]
    return argv + [url]


def gstreamer_command(url: str, width: int, height: int, cfg: StreamConfig, hardware: bool) -> list[str]:
    """gst-launch-1.0 reading raw BGR frames on stdin; nvv4l2h264enc on a Jetson, x264enc elsewhere."""
    scheme, rest = _target(url)
    fps = max(1, round(cfg.fps))
    source = (f"fdsrc fd=0 ! rawvideoparse width={width} height={height} format=bgr framerate={fps}/1 "
              "! videoconvert")
    if hardware:
        encode = (f"nvvidconv ! video/x-raw(memory:NVMM),format=NV12 ! nvv4l2h264enc bitrate={cfg.bitrate_kbps * 1000} "
                  f"insert-sps-pps=true iframeinterval={fps * 2} ! h264parse")
    else:
        encode = (
            f"video/x-raw,format=I420 ! x264enc tune=zerolatency speed-preset=ultrafast bitrate={cfg.bitrate_kbps} "
            f"key-int-max={fps * 2} ! h264parse"
        )
    if scheme in ("rtsp", "rtsps"):
        sink = f"rtspclientsink location={url} protocols=tcp"
    elif scheme in ("udp", "tcp"):
        host, _, port = rest.rstrip("/").rpartition(":")
        sink = f"mpegtsmux ! {'udpsink' if scheme == 'udp' else 'tcpclientsink'} host={host} port={port}"
    elif scheme:
        raise EdgeError(f"video.stream.url: {scheme}:// needs ffmpeg (set video.stream.encoder = \"ffmpeg\"); "
                        "GStreamer streams to rtsp://, udp://, tcp:// or a file", code="CONFIG_INVALID")
    else:
        sink = f"{_GST_FILE_MUXERS[Path(url).suffix.lower()]} ! filesink location={url}"
    return ["gst-launch-1.0", "-q", "-e", *f"{source} ! {encode} ! {sink}".split(" ")]


def _target(url: str) -> tuple[str, str]:
    try:
        return stream_target(url)
    except ValueError as exc:
        raise EdgeError(str(exc), code="CONFIG_INVALID") from None


class EncodedStream(threading.Thread):
    """Feeds the newest picture of one camera to the encoder process at a constant `fps`; restarts a failed one."""

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
        self.repeated = 0  # ticks that wrote the previous picture again (the model was slower than `fps`)
        self.restarts = 0
        self.encoder_name: str | None = None
        self.hardware = False
        self.size: tuple[int, int] | None = None
        self._proc: subprocess.Popen | None = None
        self._started_at = 0.0
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)

    def status(self) -> dict[str, Any]:
        """What `status` and the run summary show of the stream."""
        return {"url": redact(self.cfg.url), "camera": self.camera, "state": self.state, "encoder": self.encoder_name,
                "hardware": self.hardware, "frames": self.frames, "repeated": self.repeated, "restarts": self.restarts,
                "size": list(self.size) if self.size else None, "error": self.error}

    def run(self) -> None:
        try:
            self.encoder_name, self.hardware = choose_encoder(self.cfg.encoder, self.which, self.has_element)
            with self.tap.watch(self.camera):
                self._feed()
        except EdgeError as exc:
            self._fail(exc.code, str(exc))
        except Exception as exc:  # the stream must say why it stopped, never die in silence
            log.exception("video stream of %s failed", self.camera)
            self._fail("VIDEO_ENCODER_FAILED", f"{type(exc).__name__}: {exc}")
        finally:
            self.kill()
        if self.state == "running":
            self.state = "stopped"

    def _feed(self) -> None:
        interval = 1.0 / self.cfg.fps
        shot = None
        while shot is None and not self.stop_event.is_set():
            shot = self.tap.wait_next(self.camera, 0, 1.0)
        seq, picture, tick = -1, None, time.monotonic()
        while shot is not None and not self.stop_event.is_set():
            if shot.seq != seq:
                picture = self._fit(self.encoder.picture(shot, self.cfg.overlay, self.cfg.width or UNLIMITED_WIDTH))
                seq = shot.seq
            else:
                self.repeated += 1
            if not self._write(picture):
                return
            tick += interval
            if self.stop_event.wait(max(0.0, tick - time.monotonic())):
                return
            tick = max(tick, time.monotonic() - interval)  # a long stall does not turn into a burst
            shot = self.tap.latest(self.camera) or shot

    def _fit(self, picture: np.ndarray) -> np.ndarray:
        """The picture at the stream's size, fixed by the first one."""
        if self.size is None:
            self.size = stream_size(picture.shape[1], picture.shape[0])
        width, height = self.size
        if picture.shape[1] != width or picture.shape[0] != height:
            picture = cv2.resize(picture, (width, height), interpolation=cv2.INTER_AREA)
        return np.ascontiguousarray(picture)

    def _write(self, picture: np.ndarray | None) -> bool:
        """One frame into the encoder (started on the first frame, restarted when it died); False: give up."""
        assert picture is not None
        while not self.stop_event.is_set():
            if self._proc is None or self._proc.poll() is not None:
                if not self._spawn():
                    return False
            try:
                assert self._proc is not None and self._proc.stdin is not None
                self._proc.stdin.write(picture.data)
                self.frames += 1
                if self.restarts and time.monotonic() - self._started_at > HEALTHY_S:
                    self.restarts = 0
                return True
            except (BrokenPipeError, OSError, ValueError):
                self._reap()
        return False

    def _spawn(self) -> bool:
        if self._proc is not None:  # it ended: count a restart and back off
            if self.restarts >= self.cfg.restart_max:
                self._fail("VIDEO_ENCODER_FAILED", f"the encoder ended {self.restarts + 1} time(s) in a row; last: "
                           f"{(self.error or {}).get('message')}")
                return False
            self.restarts += 1
            self._proc = None
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
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
        except OSError as exc:
            self._fail("VIDEO_ENCODER_MISSING", f"cannot start {argv[0]}: {exc}")
            return False
        self._started_at = time.monotonic()
        threading.Thread(target=self._drain, args=(self._proc,), name="video-stream-stderr", daemon=True).start()
        self.state = "running"
        log.info("video: streaming %s to %s with %s%s", self.camera, redact(self.cfg.url), self.encoder_name,
                 " (hardware)" if self.hardware else "")
        return True

    def _drain(self, proc: subprocess.Popen) -> None:
        """Read the encoder's stderr as it comes (a full pipe would stall the encoder, then our writes), keeping
        the last lines for the error message."""
        assert proc.stderr is not None
        for line in proc.stderr:
            self._stderr.append(line.decode(errors="replace").rstrip())

    def _reap(self) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        tail = " | ".join(list(self._stderr)[-3:])[-500:]
        self.error = {"code": "VIDEO_ENCODER_FAILED",
                      "message": redact(f"{self.encoder_name} exited with {proc.returncode}: {tail}")}
        log.warning("video: %s", self.error["message"])

    def kill(self, grace_s: float = 5.0) -> None:
        """End the encoder: close its input (the muxer writes its trailer), then kill it after `grace_s`."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(grace_s)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(5)

    def _fail(self, code: str, message: str) -> None:
        self.state = "failed"
        self.error = {"code": code, "message": redact(message)}
        log.error("video stream: %s", self.error["message"])
        self.on_event("video_stream_failed", camera=self.camera, **self.error)
