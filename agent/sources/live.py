"""Settings shared by the live sources (v4l2, url, gstreamer), whose `grab` waits for the next frame."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agent.sources.base import SourceConfigBase

DecodeMode = Literal["on_demand", "every_frame"]


class LiveSourceConfig(SourceConfigBase):
    """A camera paced by the device or the sender."""

    decode: DecodeMode = Field(
        "on_demand",
        description="on_demand: after each grab, retrieve (decode/convert and copy) only when the consumer is "
        "expected to take a frame before the next grab; other grabs cost only the grab (agent.pipeline.on_demand). "
        "every_frame: retrieve every grab, as VideoCapture.read does.",
    )
