"""`v4l2`: a USB or CSI-bridge camera through Video4Linux2 (cv2.CAP_V4L2).

The device paces itself, so frames are read as fast as it delivers them. Before OpenCV is asked,
the device node is checked, because OpenCV only says "can't open" while the fix differs: plug the
camera in, fix the index, or add the agent user to the `video` group.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import ClassVar, Literal

import cv2
from pydantic import Field, field_validator

from agent.sources import SOURCES
from agent.sources.base import SourceError
from agent.sources.live import LiveCaptureReads, LiveSourceConfig
from agent.sources.opencv_capture import Capture

log = logging.getLogger(__name__)


class V4l2Config(LiveSourceConfig):
    """V4L2 camera settings; unset fields keep the driver's current mode."""

    kind: Literal["v4l2"] = Field("v4l2", description="Source type: selects this plugin.")
    device: int | str = Field(
        0, description="Index N for /dev/videoN, or a device path such as /dev/v4l/by-id/... (stable across replugs)."
    )
    width: int | None = Field(None, ge=16, le=7680, description="Requested frame width in pixels.")
    height: int | None = Field(None, ge=16, le=4320, description="Requested frame height in pixels.")
    fps: float | None = Field(None, gt=0, le=1000, description="Requested frame rate.")
    fourcc: str | None = Field(
        None, pattern=r"^[A-Za-z0-9 ]{4}$", description="Pixel format, e.g. MJPG (high resolutions over USB 2) or YUYV."
    )

    @field_validator("device")
    @classmethod
    def _device_path_or_index(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("device index must be >= 0")
        if isinstance(value, str) and not value.startswith("/dev/"):
            raise ValueError(f"device path {value!r} must start with /dev/ (or give the index as a number)")
        return value


def device_path(device: int | str) -> str:
    """The device node a config names."""
    return f"/dev/video{device}" if isinstance(device, int) else device


def check_device_node(path: str) -> None:
    """Raise SourceError saying what to fix when `path` cannot be a usable camera node."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise SourceError(
            f"{path}: no such device; check the camera is plugged in and camera.device "
            "(`v4l2-ctl --list-devices` lists them)"
        ) from None
    if not stat.S_ISCHR(mode):
        raise SourceError(f"{path}: not a character device; camera.device must name a /dev/video* node")
    if not os.access(path, os.R_OK | os.W_OK):
        raise SourceError(f"{path}: permission denied; add the agent user to the `video` group and restart the agent")


@SOURCES.register("v4l2")
class V4l2Source(LiveCaptureReads):
    """A Video4Linux2 camera read through OpenCV."""

    Config: ClassVar[type[V4l2Config]] = V4l2Config
    paced: ClassVar[bool] = False

    def __init__(self, config: V4l2Config) -> None:
        self.config = config
        self.path = device_path(config.device)
        self._capture = Capture(self.path)

    def open(self) -> None:
        """Open the node, request the configured mode and log the mode the driver chose."""
        check_device_node(self.path)
        self._capture.open(
            self.path,
            cv2.CAP_V4L2,
            hint="not a V4L2 capture device, or busy in another process (`fuser -v` on it); check `v4l2-ctl --all`",
        )
        self._request_mode()

    def _no_frame(self) -> SourceError:
        return SourceError(
            f"{self.path}: no frame from the device (unplugged, or stalled: check `dmesg` for USB errors)"
        )

    def frame_interval_s(self) -> None:
        """The device paces itself."""
        return None

    def _request_mode(self) -> None:
        cfg = self.config
        # V4L2 order matters: the pixel format decides which sizes and rates exist.
        wanted = [
            ("fourcc", cv2.CAP_PROP_FOURCC, cv2.VideoWriter.fourcc(*cfg.fourcc) if cfg.fourcc else None, cfg.fourcc),
            ("width", cv2.CAP_PROP_FRAME_WIDTH, cfg.width, cfg.width),
            ("height", cv2.CAP_PROP_FRAME_HEIGHT, cfg.height, cfg.height),
            ("fps", cv2.CAP_PROP_FPS, cfg.fps, cfg.fps),
        ]
        for name, prop, value, asked in wanted:  # `asked`: as configured (a fourcc's text, not its code)
            if value is not None and not self._capture.set(prop, float(value)):
                log.warning("camera %s: %s refused %s=%s", cfg.name, self.path, name, asked)
        width, height, fps, fourcc = self._actual_mode()
        log.info("camera %s: %s opened at %dx%d %.1f fps %s", cfg.name, self.path, width, height, fps, fourcc)
        if (cfg.width and width != cfg.width) or (cfg.height and height != cfg.height):
            asked = f"{cfg.width or width}x{cfg.height or height}"
            log.warning(
                "camera %s: asked for %s, the driver gave %dx%d; see `v4l2-ctl --list-formats-ext`",
                cfg.name, asked, width, height,
            )

    def _actual_mode(self) -> tuple[int, int, float, str]:
        code = int(self._capture.get(cv2.CAP_PROP_FOURCC))
        fourcc = "".join(chr((code >> (8 * i)) & 0xFF) for i in range(4)) if code else "?"
        width = int(self._capture.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(self._capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        return width, height, self._capture.get(cv2.CAP_PROP_FPS), fourcc
