"""`[video]`: who may look at the cameras, how often and at what quality (docs/video.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from agent.base.addresses import NotHostPort, is_loopback, split_host_port
from agent.base.names import CAMERA_NAME_PATTERN


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StreamConfig(_Strict):
    """`[video.stream]`: one camera as an H.264 stream through an encoder process (GStreamer or ffmpeg)."""

    url: str = Field("", max_length=2048, description="Where the stream goes: rtsp://server:8554/path (push to an "
                     "RTSP server such as MediaMTX), udp://host:port or tcp://host:port (MPEG-TS), or a file path "
                     "(.ts, .mp4, .mkv). Empty: no stream.")
    camera: str | None = Field(None, pattern=CAMERA_NAME_PATTERN, description="Camera streamed; default: the first.")
    encoder: Literal["auto", "gstreamer", "ffmpeg"] = Field(
        "auto", description="auto: GStreamer with nvv4l2h264enc where it exists (Jetson), else ffmpeg with libx264, "
        "else GStreamer with x264enc.")
    fps: float = Field(15.0, gt=0, le=60, description="Frames per second written to the encoder.")
    bitrate_kbps: int = Field(2000, ge=100, le=50000, description="Target bitrate of the H.264 stream.")
    overlay: bool = Field(True, description="Draw the results on the streamed frames.")
    width: int = Field(0, ge=0, le=3840, description="Width of the stream (height keeps the aspect); 0: the camera's.")
    restart_max: int = Field(5, ge=0, le=1000, description="Restarts of a failed encoder in a row (a minute of "
                             "healthy streaming clears the count) before the stream gives up.")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if value:
            stream_target(value)
        return value


STREAM_SCHEMES = ("rtsp", "rtsps", "udp", "tcp", "srt", "rtp")  # srt and rtp: ffmpeg only
FILE_SUFFIXES = (".ts", ".mp4", ".mkv")


def stream_target(url: str) -> tuple[str, str]:
    """(scheme, rest) of a stream URL, scheme "" for a file path; ValueError naming what is wrong. One parser for
    both encoders' command lines, so a URL means the same to ffmpeg and to GStreamer."""
    if any(ch.isspace() for ch in url):
        raise ValueError(f"video.stream.url {url!r} must not contain spaces")
    scheme, sep, rest = url.partition("://")
    if not sep:
        if not url.lower().endswith(FILE_SUFFIXES):
            raise ValueError(f"video.stream.url {url!r}: a file must end in {', '.join(FILE_SUFFIXES)}")
        return "", url
    scheme = scheme.lower()
    if scheme not in STREAM_SCHEMES:
        raise ValueError(f"video.stream.url: unsupported scheme {scheme!r} (rtsp://, rtsps://, udp://, tcp://, "
                         "srt://, rtp:// or a file path)")
    if scheme in ("udp", "tcp", "srt", "rtp"):
        host, _, port = rest.split("?")[0].rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"video.stream.url {url!r}: {scheme}:// needs host:port")
    return scheme, rest


class VideoConfig(_Strict):
    """Video out: MJPEG over HTTP, an H.264 stream and MQTT snapshots, drawn and encoded only when watched.

    With nobody looking the frame path keeps no frame at all (docs/video.md)."""

    enabled: bool = Field(False, description="Serve MJPEG over HTTP (/cameras/<name>.mjpg, .jpg, and an index page).")
    listen: str = Field("127.0.0.1:8090", description="host:port of the MJPEG server. Any address other than "
                        "loopback needs `token` or `token_file`.")
    token: SecretStr | None = Field(None, min_length=16, max_length=256,
                                    description="Bearer token viewers must send (Authorization header or ?token=); "
                                    "at least 16 characters.")
    token_file: Path | None = Field(None, description="File holding the token (first line); beats `token`.")
    max_fps: float = Field(15.0, gt=0, le=60, description="Most frames per second sent to one viewer.")
    max_clients: int = Field(4, ge=1, le=64, description="Streams served at once; more get 503. Other requests "
                             "have 8 places of their own, and connections still sending their request 8 more "
                             "(each request head within 5 s in all).")
    send_timeout_s: float = Field(2.0, gt=0, le=60, description="A viewer that takes longer than this to accept "
                                  "one frame is dropped (frames are never queued for a slow viewer).")
    quality: int = Field(80, ge=10, le=100, description="JPEG quality of the MJPEG frames and snapshots.")
    max_width: int = Field(1280, ge=64, le=7680, description="Frames wider than this are scaled down before encoding.")
    overlay: bool = Field(True, description="Draw results by default (a viewer may ask ?overlay=0).")
    snapshots: bool = Field(True, description="Answer the MQTT `snapshot` command (works with `enabled` false).")
    snapshot_max_bytes: int = Field(200_000, ge=4096, le=1024 * 1024,
                                    description="Largest snapshot JPEG; quality, then size, are lowered to fit.")
    snapshot_min_interval_s: float = Field(1.0, ge=0, le=3600, description="Snapshots of one camera at most this "
                                           "often (more get RATE_LIMITED).")
    snapshot_interval_s: float = Field(0.0, ge=0, le=86400, description="Publish a snapshot of every camera this "
                                       "often (reason `periodic`); 0: only on command.")
    snapshot_wait_s: float = Field(3.0, gt=0, le=60, description="How long a snapshot waits for the camera's next "
                                   "frame before VIDEO_UNAVAILABLE.")
    stream: StreamConfig = Field(default_factory=StreamConfig, description="An H.264 stream of one camera.")

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        host_port(value)
        return value

    @model_validator(mode="after")
    def _token_off_loopback(self) -> "VideoConfig":
        host, _ = host_port(self.listen)
        if self.enabled and not is_loopback(host) and self.token is None and self.token_file is None:
            raise ValueError(f"listen {self.listen!r} is not a loopback address: set video.token or "
                             "video.token_file (viewers send it as a Bearer token)")
        return self

    def resolve_token(self) -> str | None:
        """The token viewers must send, None on loopback without one."""
        if self.token_file is not None:
            text = self.token_file.read_text(encoding="utf-8").strip().splitlines()
            token = text[0].strip() if text else ""
            if len(token) < 16:
                raise ValueError(f"video.token_file {self.token_file}: the token must be at least 16 characters")
            return token
        return self.token.get_secret_value() if self.token is not None else None


def host_port(listen: str) -> tuple[str, int]:
    """`host:port` (`[v6]:port` too) as (host, port); ValueError naming the problem."""
    try:
        return split_host_port(listen)
    except NotHostPort:
        raise ValueError(f"{listen!r} is not host:port") from None
    except ValueError as exc:
        raise ValueError(f"{listen!r}: {exc}") from None
