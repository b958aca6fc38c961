"""What the live sources (v4l2, url, gstreamer) share: their `decode` setting and their read/grab/retrieve
over an OpenCV capture, whose `grab` waits for the next frame."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from agent.sources.base import SourceConfigBase, SourceError

DecodeMode = Literal["on_demand", "every_frame"]


class LiveSourceConfig(SourceConfigBase):
    """A camera paced by the device or the sender."""

    decode: DecodeMode = Field(
        "on_demand",
        description="on_demand: after each grab, retrieve (decode/convert and copy) only when the consumer is "
        "expected to take a frame before the next grab; other grabs cost only the grab (agent.pipeline.on_demand). "
        "every_frame: retrieve every grab, as VideoCapture.read does.",
    )


class LiveCaptureReads:
    """read/grab/retrieve/close of a live source over its `_capture` (agent.sources.opencv_capture.Capture).

    A missing frame is the source's own `_no_frame()` error (each says what to check for its kind). What
    `retrieve` costs, and so what a skipped retrieve saves (agent.pipeline.on_demand): V4L2, the MJPEG
    decode or YUYV conversion and the copy; FFmpeg, the conversion from the codec's YUV and the copy (the
    decode happens in grab: inter frames need every one); GStreamer, the copy out of the appsink buffer
    (the pipeline itself decoded and converted the sample).
    """

    _capture: Any

    def _no_frame(self) -> SourceError:
        raise NotImplementedError

    def read(self) -> np.ndarray:
        """Next frame as BGR; none is the source's lost-camera error."""
        image = self._capture.read()
        if image is None:
            raise self._no_frame()
        return image

    def grab(self) -> bool:
        """Wait for the next frame and take it from the backend without converting it."""
        if not self._capture.grab():
            raise self._no_frame()
        return True

    def retrieve(self) -> np.ndarray | None:
        """The last grabbed frame as BGR (the backend's decode/conversion and the copy happen here)."""
        return self._capture.retrieve()

    def close(self) -> None:
        """Release the capture; safe to call twice."""
        self._capture.close()

