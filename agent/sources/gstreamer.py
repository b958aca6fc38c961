"""`gstreamer`: a GStreamer pipeline ending in appsink, read through OpenCV (cv2.CAP_GSTREAMER).

On Jetson this is the way to CSI cameras (nvarguscamerasrc) and to hardware decoding (nvv4l2decoder).
It needs an OpenCV built with GStreamer; the pip wheels are not, so the source refuses to start with
the fix instead of failing every reopen with "could not open".

`decode = "on_demand"` (the default) gates the retrieve as for the other live sources
(agent.pipeline.on_demand), but here it saves less: the pipeline itself decodes and converts (on a
Jetson in NVDEC and VIC hardware, before appsink), so a skipped retrieve saves only OpenCV's copy of
the sample into a new array (about 0.9 MB at 640x480 BGR, 6 MB at 1080p), plus the colour conversion
when the appsink caps are not BGR (OpenCV converts e.g. NV12 or I420 in retrieve). Stale frames are
kept out by the pipeline itself: end it in `appsink drop=true max-buffers=1`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar, Literal

import cv2
from pydantic import ConfigDict, Field, field_validator, model_validator

from agent.sources import SOURCES
from agent.sources.base import SourceError
from agent.sources.live import LiveCaptureReads, LiveSourceConfig
from agent.sources.opencv_capture import Capture, RedactedInput, redact

log = logging.getLogger(__name__)

NO_GSTREAMER = (
    "this OpenCV ({version}) has no GStreamer support: the pip opencv-python wheels are built without "
    "GStreamer; on Jetson use JetPack's OpenCV (python3-opencv) in a venv created with --system-site-packages"
)


class GStreamerConfig(LiveSourceConfig):
    """GStreamer pipeline settings."""

    # A pipeline may hold a camera URL with a password (rtspsrc location=...): keep it out of errors.
    model_config = ConfigDict(hide_input_in_errors=True)

    kind: Literal["gstreamer"] = Field("gstreamer", description="Source type: selects this plugin.")
    pipeline: str = Field(
        min_length=1,
        repr=False,
        description="gst-launch-1.0 style pipeline ending in appsink, e.g. "
        "nvarguscamerasrc ! nvvidconv ! video/x-raw,format=BGRx ! videoconvert ! video/x-raw,format=BGR "
        "! appsink drop=true",
    )

    @model_validator(mode="before")
    @classmethod
    def _hide_urls_in_errors(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("pipeline"), str):
            data = {**data, "pipeline": RedactedInput(data["pipeline"])}
        return data

    @field_validator("pipeline")
    @classmethod
    def _ends_in_appsink(cls, value: str) -> str:
        last = value.rsplit("!", 1)[-1].split()
        if not last or last[0] != "appsink":
            raise ValueError(
                "pipeline must end in appsink (OpenCV pulls frames from it), e.g. '... ! appsink drop=true'"
            )
        return value


def gstreamer_supported(build_information: str) -> bool:
    """Whether cv2.getBuildInformation() text says the Video I/O GStreamer backend is built in."""
    return re.search(r"^\s*GStreamer:\s*YES\b", build_information, re.MULTILINE) is not None


@SOURCES.register("gstreamer")
class GStreamerSource(LiveCaptureReads):
    """Frames from a GStreamer appsink."""

    Config: ClassVar[type[GStreamerConfig]] = GStreamerConfig
    paced: ClassVar[bool] = False

    def __init__(self, config: GStreamerConfig) -> None:
        """Refuse at creation, not at every reopen, when this OpenCV cannot run pipelines at all."""
        if not gstreamer_supported(cv2.getBuildInformation()):
            raise SourceError(NO_GSTREAMER.format(version=cv2.__version__), code="CAMERA_UNSUPPORTED")
        self.config = config
        self._capture = Capture(f"camera {config.name} (gstreamer)")

    def open(self) -> None:
        """Start the pipeline; the error says how to debug it outside the agent."""
        self._capture.open(
            self.config.pipeline,
            cv2.CAP_GSTREAMER,
            hint="run the pipeline with `gst-launch-1.0`, appsink replaced by fakesink, to see GStreamer's error "
            "(for CSI cameras on Jetson, also `systemctl status nvargus-daemon`)",
        )
        log.info("camera %s: pipeline started: %s", self.config.name, redact(self.config.pipeline))

    def _no_frame(self) -> SourceError:
        return SourceError(
            f"camera {self.config.name} (gstreamer): pipeline stopped (EOS or error); "
            "run it with gst-launch-1.0 to see why"
        )

    def frame_interval_s(self) -> None:
        """The pipeline paces itself."""
        return None
