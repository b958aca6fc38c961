"""Live cameras retrieve only the grabs the consumer will take (`decode = "on_demand"`).

A live source's `grab` blocks until the device or the sender delivers the next frame, and an OpenCV
capture is not thread-safe (`retrieve` returns the *last* grab), so the consumer cannot retrieve
late as paced sources do (agent.sources.lazy). Instead the capture thread, the only thread that
touches the source, asks agent.pipeline.demand after every grab whether the consumer will take a frame
before the next grab completes. If so it retrieves and puts a normal Frame; if not it skips the
retrieve, and the older unread frame leaves the mailbox as a drop, so the consumer never gets a frame
several intervals old: at a take the frame is at most one grab older than the newest grab.

What a skipped retrieve saves depends on the backend: V4L2 with MJPEG, the JPEG decode and conversion
(YUYV: the conversion to BGR); FFmpeg, the conversion to BGR and the copy (the decode itself happens in
grab: inter-frame codecs need every frame); GStreamer, the copy out of the appsink buffer (see
agent.sources.gstreamer).
"""

from __future__ import annotations

import time
from typing import Callable, TypeGuard

from agent.pipeline.demand import DemandEstimator
from agent.pipeline.mailbox import FreshestMailbox
from agent.sources.base import Frame, FrameSource, GrabbingSource
from agent.sources.lazy import GrabCounts, retrieved_image
from agent.sources.live import LiveSourceConfig


def decodes_on_demand(source: FrameSource) -> TypeGuard[GrabbingSource]:
    """True for live (unpaced) sources that can grab and retrieve and whose config asks for on-demand decoding
    (the `decode` setting of every live source's config, agent.sources.live.LiveSourceConfig)."""
    return (
        not source.paced
        and isinstance(source, GrabbingSource)
        and isinstance(source.config, LiveSourceConfig)
        and source.config.decode == "on_demand"
    )


class OnDemandGrabber:
    """One live source's grab, the retrieve decision, and the put; counts into `stats`."""

    def __init__(
        self,
        source: GrabbingSource,
        mailbox: FreshestMailbox[Frame],
        name: str,
        stats: GrabCounts,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.mailbox = mailbox
        self.name = name
        self.stats = stats
        self._clock = clock
        self.estimator = DemandEstimator()
        self._last_put: Frame | None = None

    def reset(self) -> None:
        """Forget the grab history (after a reopen the first interval is the outage, not the frame rate)."""
        self.estimator = DemandEstimator()
        self._last_put = None

    def grab_and_put(self, index: int) -> bool:
        """Grab; retrieve and put when the consumer will want it. False at a clean end of stream."""
        if not self.source.grab():
            return False
        now = self._clock()
        self.stats.grabbed += 1
        self.estimator.observe_grab(now)
        self.estimator.observe_takes(*self.mailbox.takes())
        if not self.estimator.should_retrieve(now):
            if self._last_put is not None:
                self.mailbox.discard(self._last_put)  # a drop: it is now older than the newest grab
                self._last_put = None
            return True
        self._put(index, now)
        return True

    def _put(self, index: int, grabbed_at: float) -> None:
        self.stats.decoded += 1
        image = self.source.retrieve()
        self.estimator.observe_retrieve(self._clock() - grabbed_at)
        frame = Frame(retrieved_image(image, self.name), index, grabbed_at, self.name)
        self.mailbox.put(frame)
        self._last_put = frame
