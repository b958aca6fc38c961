"""The capture thread: reads a source into the mailbox, reopening it with exponential backoff.

Loss and recovery are logged, counted and reported through `on_event`, so a camera unplugged for
an hour shows up as one `camera_lost` and one `camera_recovered` event, not a crashed agent.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from agent.pipeline.mailbox import FreshestMailbox
from agent.pipeline.on_demand import OnDemandGrabber, decodes_on_demand
from agent.sources.base import FiniteSource, Frame, FrameSource, SourceError, frame_meta_reader, validate_image
from agent.sources.lazy import GrabCounts, LazyGrabber, can_grab

log = logging.getLogger(__name__)

EventSink = Callable[..., None]


@dataclass
class CaptureStats(GrabCounts):
    """Counters the run summary and telemetry report (with `grabbed`, `decoded`, `skipped`, `bad_frames`)."""

    frames: int = 0
    losses: int = 0
    recoveries: int = 0
    reopen_attempts: int = 0
    connected: bool = False
    ended: bool = False


class CaptureThread(threading.Thread):
    """Drives one FrameSource until `stop_event` is set."""

    def __init__(
        self,
        source: FrameSource,
        mailbox: FreshestMailbox[Frame],
        stop_event: threading.Event,
        on_event: EventSink | None = None,
    ) -> None:
        super().__init__(name=f"capture-{source.config.name}", daemon=True)
        self.source = source
        self.mailbox = mailbox
        self.stop_event = stop_event
        self.on_event = on_event or (lambda *a, **k: None)
        self.stats = CaptureStats()
        self._camera = source.config.name
        self._backoff = source.config.reopen_initial_s
        self._lost_since: float | None = None
        self._frame_meta = frame_meta_reader(source)  # asked once: see frame_meta_reader
        # paced sources that can grab: frames replaced unread are never decoded (agent.sources.lazy)
        self.grabber = LazyGrabber(source, mailbox, self._camera, self.stats) if can_grab(source) else None
        # live sources: grabs the consumer will not take are never retrieved (agent.pipeline.on_demand)
        self.on_demand = (OnDemandGrabber(source, mailbox, self._camera, self.stats)
                          if decodes_on_demand(source) else None)

    def run(self) -> None:
        """Open, read, and on failure back off and reopen, until stopped (or a finite source ends)."""
        while not self.stop_event.is_set() and not self.stats.ended:
            if not self._open():
                self._wait_backoff()
                continue
            self._read_until_failure()
            self._close_source()
        self._close_source()

    def _close_source(self) -> None:
        if self.grabber is not None:
            self.grabber.close()  # waits for a retrieve in progress on the consumer's thread
        else:
            self.source.close()

    def _open(self) -> bool:
        self.stats.reopen_attempts += 1
        try:
            self.source.open()
        except SourceError as exc:
            self._lost(str(exc), exc.code)
            return False
        except Exception as exc:  # a backend bug must not kill the thread
            log.exception("camera %s: unexpected error while opening", self._camera)
            self._lost(f"unexpected: {exc}")
            return False
        self._connected()
        if self.on_demand is not None:
            self.on_demand.reset()
        return True

    def _read_until_failure(self) -> None:
        interval = self.source.frame_interval_s() if self.source.paced else None
        next_due = time.monotonic()
        while not self.stop_event.is_set():
            if interval is not None:
                next_due += interval
                delay = next_due - time.monotonic()
                if delay > 0 and self.stop_event.wait(delay):
                    return
                if delay < -interval:  # fell behind: resynchronise instead of bursting
                    next_due = time.monotonic()
            if not self._read_one():
                return

    def _read_one(self) -> bool:
        try:
            grabber = self.grabber or self.on_demand
            if grabber is not None:
                return self._grab_one(grabber)
            image = self.source.read()
            if image is None:
                return self._end_of_stream()
            self.stats.grabbed += 1
            self.stats.decoded += 1
            image = validate_image(image, self._camera)
        except SourceError as exc:
            if exc.code == "CAMERA_BAD_FRAME":
                self.stats.bad_frames += 1
                log.warning("camera %s: %s", self._camera, exc)
                return True
            self._lost(str(exc), exc.code)
            return False
        except Exception as exc:
            log.exception("camera %s: unexpected read error", self._camera)
            self._lost(f"unexpected: {exc}")
            return False
        self.stats.frames += 1
        self.mailbox.put(Frame(image, self.stats.frames, time.monotonic(), self._camera, self._frame_meta()))
        return True

    def _grab_one(self, grabber: LazyGrabber | OnDemandGrabber) -> bool:
        """Grab and offer the next frame through `grabber`: a paced source's LazyFrame (the consumer decodes
        only the frames it takes), or a live source's frame retrieved only when it will be taken."""
        if not grabber.grab_and_put(self.stats.frames + 1):
            return self._end_of_stream()
        self.stats.frames += 1
        return True

    def _end_of_stream(self) -> bool:
        if isinstance(self.source, FiniteSource) and self.source.finite:
            self.stats.ended = True
            log.info("camera %s: end of input after %d frames", self._camera, self.stats.frames)
            self.on_event("camera_ended", camera=self._camera, frames=self.stats.frames)
            return False
        self._lost("end of stream")
        return False

    def _connected(self) -> None:
        self._backoff = self.source.config.reopen_initial_s
        self.stats.connected = True
        if self._lost_since is not None:
            down_s = time.monotonic() - self._lost_since
            self.stats.recoveries += 1
            log.info("camera %s recovered after %.1f s", self._camera, down_s)
            self.on_event("camera_recovered", camera=self._camera, down_s=round(down_s, 2))
            self._lost_since = None

    def _lost(self, reason: str, code: str = "CAMERA_FAILED") -> None:
        self.stats.connected = False
        if self._lost_since is None:
            self._lost_since = time.monotonic()
            self.stats.losses += 1
            log.warning("camera %s lost: %s (reopening with backoff)", self._camera, reason)
            self.on_event("camera_lost", camera=self._camera, code=code or "CAMERA_FAILED", reason=reason)
        else:
            log.debug("camera %s still down: %s", self._camera, reason)

    def _wait_backoff(self) -> None:
        self.stop_event.wait(self._backoff)
        self._backoff = min(self._backoff * 2, self.source.config.reopen_max_s)
