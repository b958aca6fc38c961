"""`url`: an RTSP, HTTP, TCP or UDP stream decoded by OpenCV's FFmpeg backend (cv2.CAP_FFMPEG).

Open and read timeouts go to OpenCV as open parameters, so a dead camera fails an open or a read in
bounded time and the capture thread can reopen it. Credentials in the URL never reach a log line,
an event or an error: every message goes through `redact`.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from typing import Any, ClassVar, Iterator, Literal

import cv2
from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from agent.sources import SOURCES
from agent.sources.base import SourceError
from agent.sources.live import LiveCaptureReads, LiveSourceConfig
from agent.sources.opencv_capture import Capture, RedactedInput, redact

log = logging.getLogger(__name__)

SCHEMES = ("rtsp", "rtsps", "rtmp", "http", "https", "tcp", "udp")
FFMPEG_OPTIONS_ENV = "OPENCV_FFMPEG_CAPTURE_OPTIONS"

# OpenCV reads FFMPEG_OPTIONS_ENV from the process environment inside each open. Every url open holds
# this lock, so one stream's transport never leaks into another's open (the cost: opens of several
# cameras run one after another, each bounded by its open_timeout_ms).
_OPEN_LOCK = threading.Lock()


class UrlConfig(LiveSourceConfig):
    """Network stream settings."""

    # Errors must not echo the URL, which may carry a password. This setting only covers validation
    # of UrlConfig itself; nested in a larger config, `RedactedInput` keeps the URL out of str(error).
    model_config = ConfigDict(hide_input_in_errors=True)

    kind: Literal["url"] = Field("url", description="Source type: selects this plugin.")
    url: str = Field(
        repr=False,
        description="Stream URL, e.g. rtsp://user:pass@10.0.0.5:554/stream1 (credentials are redacted in logs).",
    )
    open_timeout_ms: int = Field(10_000, ge=100, le=600_000, description="Give up opening the stream after this long.")
    read_timeout_ms: int = Field(
        5_000, ge=100, le=600_000, description="A read that waits longer counts as a lost stream."
    )
    transport: Literal["tcp", "udp"] | None = Field(
        None,
        description="RTSP only: tcp survives lossy Wi-Fi and NAT, udp has less latency; default: OpenCV's choice, "
        "tcp (udp if OPENCV_FFMPEG_CAPTURE_OPTIONS is set in the environment).",
    )

    @model_validator(mode="before")
    @classmethod
    def _hide_url_in_errors(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("url"), str):
            data = {**data, "url": RedactedInput(data["url"])}
        return data

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        scheme, sep, _ = value.partition("://")
        if not sep or scheme.lower() not in SCHEMES:
            raise ValueError(f"URL must start with one of {', '.join(s + '://' for s in SCHEMES)}")
        return value

    @field_validator("transport")
    @classmethod
    def _transport_is_rtsp_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        # A field validator, not a model one: a model error would print the whole input, URL included.
        url = info.data.get("url")  # absent when the URL itself failed: that error is enough
        if value is not None and url is not None and not url.lower().startswith(("rtsp://", "rtsps://")):
            raise ValueError("transport applies to rtsp:// URLs only; remove it for this URL")
        return value


@contextmanager
def ffmpeg_capture_options(extra: str | None) -> Iterator[None]:
    """Add FFmpeg demuxer options for one open, keeping any the operator set, then restore them."""
    with _OPEN_LOCK:
        previous = os.environ.get(FFMPEG_OPTIONS_ENV)
        if extra:
            # OpenCV parses "key;value|key;value"; a later key wins, so ours go last.
            os.environ[FFMPEG_OPTIONS_ENV] = f"{previous}|{extra}" if previous else extra
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(FFMPEG_OPTIONS_ENV, None)
            else:
                os.environ[FFMPEG_OPTIONS_ENV] = previous


def timeout_params(open_ms: int, read_ms: int) -> list[int]:
    """VideoCapture open parameters for the timeouts; empty on OpenCV builds that lack them."""
    open_prop = getattr(cv2, "CAP_PROP_OPEN_TIMEOUT_MSEC", None)
    read_prop = getattr(cv2, "CAP_PROP_READ_TIMEOUT_MSEC", None)
    if open_prop is None or read_prop is None:
        log.warning("this OpenCV has no stream timeout properties: a dead camera may block an open or a read for 30 s")
        return []
    return [open_prop, open_ms, read_prop, read_ms]


@SOURCES.register("url")
class UrlSource(LiveCaptureReads):
    """A network stream read through FFmpeg."""

    Config: ClassVar[type[UrlConfig]] = UrlConfig
    paced: ClassVar[bool] = False

    def __init__(self, config: UrlConfig) -> None:
        self.config = config
        self.display_url = redact(config.url)
        self._capture = Capture(self.display_url)

    def open(self) -> None:
        """Connect within `open_timeout_ms`; the error says what to check."""
        cfg = self.config
        options = f"rtsp_transport;{cfg.transport}" if cfg.transport else None
        with ffmpeg_capture_options(options):
            self._capture.open(
                cfg.url,
                cv2.CAP_FFMPEG,
                timeout_params(cfg.open_timeout_ms, cfg.read_timeout_ms),
                hint=self._open_hint(),
            )
        log.info("camera %s: %s opened (%s)", cfg.name, self.display_url, self._capture.backend())

    def _no_frame(self) -> SourceError:
        return SourceError(
            f"{self.display_url}: stream ended or no frame within {self.config.read_timeout_ms} ms "
            "(server gone, camera rebooting, or network down)"
        )

    def frame_interval_s(self) -> None:
        """The sender paces the stream."""
        return None

    def _open_hint(self) -> str:
        hint = (
            f"nothing playable within {self.config.open_timeout_ms} ms (FFmpeg's reason is on stderr); "
            "check the host answers (ping), the port, the path and the credentials"
        )
        if self.config.url.lower().startswith("rtsp"):
            # Unset transport is TCP: OpenCV asks for it unless OPENCV_FFMPEG_CAPTURE_OPTIONS is set.
            other = "tcp" if self.config.transport == "udp" else "udp"
            hint += f', and try transport = "{other}" (UDP is often blocked by NAT; some cameras only send UDP)'
        return hint
