"""Grab on the capture thread, decode on the consumer's: frames replaced unread cost only their grab.

The capture thread calls `grab_and_put` once per frame interval: the source advances one frame (for a
video: demux and decode, which inter-frame codecs need for every frame; for an image folder: the next
file name) and a `LazyFrame` goes into the mailbox with the grab's timestamp. Only when the consumer
uses `frame.image` does the source `retrieve` it (colour conversion and copy; for an image folder the
whole JPEG/PNG decode). A frame replaced in its mailbox unread is never retrieved.

OpenCV captures are not thread-safe and `retrieve` returns the *last* grab, so grab and retrieve share
one lock, and a frame taken just before the capture thread grabbed again is served as that newer frame
(index and timestamp move with it, and the newer frame is taken out of the mailbox so it is not served
twice). Frames are never served older than they claim to be.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol, TypeGuard

import numpy as np

from agent.sources.base import (
    Frame,
    FrameSource,
    GrabbingSource,
    KnowsLastFrame,
    LazyFrame,
    SourceError,
    frame_meta_reader,
    validate_image,
)

log = logging.getLogger(__name__)


class FrameSlot(Protocol):
    """Where grabbed frames wait for the consumer (agent.pipeline.mailbox.FreshestMailbox, on the frame path's side)."""

    def put(self, item: Frame) -> bool: ...

    def discard(self, item: Frame) -> bool: ...


def can_grab(source: FrameSource) -> TypeGuard[GrabbingSource]:
    """True for paced sources that split read into grab + retrieve (see GrabbingSource)."""
    return bool(source.paced) and isinstance(source, GrabbingSource)


def retrieved_image(image: np.ndarray | None, name: str) -> np.ndarray:
    """A retrieve's result as a checked frame; no image for a grabbed frame is a bad frame, not a lost camera."""
    if image is None:
        raise SourceError(f"{name}: the backend returned no image for a grabbed frame", code="CAMERA_BAD_FRAME")
    return validate_image(image, name)


@dataclass
class GrabCounts:
    """Grabs and retrieves of one camera, the same names for every way of reading it (status, summary, telemetry).

    `grabbed`: frames the source advanced past; `decoded`: retrieves (decode/convert and copy);
    `skipped`: grabs never retrieved (for lazily decoded frames: not retrieved yet).
    """

    grabbed: int = 0
    decoded: int = 0
    bad_frames: int = 0

    @property
    def skipped(self) -> int:
        """Grabs that cost only the grab."""
        return max(self.grabbed - self.decoded, 0)


class LazyGrabber:
    """One source's grab/retrieve protocol around a mailbox; counts grabs and decodes."""

    def __init__(self, source: GrabbingSource, mailbox: FrameSlot, name: str, stats: GrabCounts | None = None) -> None:
        self.source = source
        self.mailbox = mailbox
        self.name = name
        # the capture thread's CaptureStats: grabs, retrieves and bad frames found at retrieve count there
        self.stats = stats if stats is not None else GrabCounts()
        self._lock = threading.Lock()
        self._current: LazyFrame | None = None  # the frame the source's last grab belongs to
        # what the source can say, asked once (an isinstance per grab would cost more than the answer)
        self._frame_meta = frame_meta_reader(source)
        self._knows_last: KnowsLastFrame | None = source if isinstance(source, KnowsLastFrame) else None

    def grab_and_put(self, index: int) -> bool:
        """Grab the next frame and offer it; False at a clean end of stream (SourceError on failure)."""
        with self._lock:
            if not self.source.grab():
                self._current = None
                return False
            frame = LazyFrame(index, time.monotonic(), self.name, self._load)
            frame.meta.update(self._frame_meta())
            self._current = frame
            self.stats.grabbed += 1
            self.mailbox.put(frame)  # under the lock: a late retrieve sees the mailbox and the source agree
            last = self._at_last_frame()
        if last:
            self._preload(frame)
        return True

    def _at_last_frame(self) -> bool:
        return self._knows_last is not None and bool(self._knows_last.at_last_frame())

    def _preload(self, frame: LazyFrame) -> None:
        """The end of a finite input: the next grab fails and takes this frame's pixels with it, so make them now."""
        try:
            _ = frame.image
        except SourceError as exc:
            log.warning("camera %s: last frame unreadable: %s", self.name, exc)

    def close(self) -> None:
        """Close the source under the lock (never during a retrieve); frames still out fail cleanly."""
        with self._lock:
            self._current = None
            self.source.close()

    def _load(self, frame: LazyFrame) -> np.ndarray:
        with self._lock:
            newest = self._current
            if newest is None:
                raise SourceError(
                    f"{self.name}: the source was closed before the frame was used", code="CAMERA_BAD_FRAME"
                )
            if newest is not frame:
                self._serve_newer(frame, newest)
            image = self.source.retrieve()
            self.stats.decoded += 1
        try:
            return retrieved_image(image, self.name)
        except SourceError:
            self.stats.bad_frames += 1
            raise

    @property
    def grabbed(self) -> int:
        """Frames grabbed."""
        return self.stats.grabbed

    @property
    def decoded(self) -> int:
        """Retrieves: frames the consumer used."""
        return self.stats.decoded

    def _serve_newer(self, frame: LazyFrame, newest: LazyFrame) -> None:
        """The source grabbed again after `frame` was taken: `frame` becomes that newer frame."""
        frame.index, frame.captured_at = newest.index, newest.captured_at
        # served once, through `frame`: the newer frame leaves the mailbox as a drop (`frame` was already
        # counted delivered when taken), so delivered + dropped + (slot full) still equals the frames put.
        # discard checks and counts under the mailbox's lock: a reader of the counters never sees them mid-edit.
        self.mailbox.discard(newest)
        self._current = frame
