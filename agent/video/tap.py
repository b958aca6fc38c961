"""The frame path's one touch point with video: the newest frame and result per camera, kept only while
somebody watches that camera (a viewer, a stream, a pending snapshot).

`offer` runs on the results thread for every frame. With nobody watching it reads one dict entry and
returns: no copy, no lock, no drawing, no encoding (`skipped` counts those frames, so a test can prove it).
With a watcher it keeps a reference to the frame's array and result (the camera never writes into an array
it handed out) and wakes the video threads, which do all the work.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from agent.tracking.types import TrackedResult
from agent.video.overlay import OverlayStyle
from engines.postprocess.base import InferenceResult


@dataclass(frozen=True)
class Shot:
    """One frame of one camera and what the model made of it."""

    camera: str
    seq: int  # per tap, increasing: a watcher asks for anything newer than the last it saw
    frame_index: int
    image: np.ndarray
    result: InferenceResult | None
    captured_at: float  # time.monotonic() at capture: the glass-to-glass clock starts here
    captured_wall: float  # the same instant on the wall clock (snapshots carry it)
    style: OverlayStyle = field(default_factory=OverlayStyle)
    tracking: TrackedResult | None = None  # the frame's tracks, zones and lines (agent.tracking), when tracked


class FrameTap:
    """Newest Shot per watched camera; `watch` marks interest, `wait_next` hands over newer shots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conds: dict[
            str, threading.Condition
        ] = {}  # one per camera, all on `_lock`: a frame wakes its own waiters
        self._latest: dict[str, Shot] = {}
        self._watchers: Counter[str] = Counter()
        self._seq = 0
        self._styles: dict[int, tuple[Any, OverlayStyle]] = {}
        self.kept = 0  # frames kept for a watcher
        self.skipped = 0  # frames nobody watched: nothing was done for them

    def offer(self, camera: str, frame_index: int, image: np.ndarray, result: InferenceResult | None,
              captured_at: float, runtime: Any = None, tracking: TrackedResult | None = None) -> None:
        """Called for every delivered frame; does nothing unless `camera` is watched."""
        if not self._watchers.get(camera):
            self.skipped += 1
            return
        style = self._style(runtime)
        wall = time.time() - (time.monotonic() - captured_at)
        with self._lock:
            if not self._watchers.get(camera):  # the last watcher left meanwhile: keep nothing
                return
            self._seq += 1
            self._latest[camera] = Shot(camera, self._seq, frame_index, image, result, captured_at, wall, style,
                                        tracking)
            self.kept += 1
            self._cond(camera).notify_all()

    def _cond(self, camera: str) -> threading.Condition:
        """The camera's condition (caller holds `_lock`)."""
        cond = self._conds.get(camera)
        if cond is None:
            cond = self._conds[camera] = threading.Condition(self._lock)
        return cond

    def _style(self, runtime: Any) -> OverlayStyle:
        """The overlay style of `runtime`, worked out once per model (a swap brings a new runtime)."""
        if runtime is None:
            return OverlayStyle()
        cached = self._styles.get(id(runtime))
        if cached is not None and cached[0] is runtime:
            return cached[1]
        style = OverlayStyle.of(runtime)
        self._styles = {id(runtime): (runtime, style)}  # only the newest model's: an old one may be freed
        return style

    @contextmanager
    def watch(self, camera: str) -> Iterator[None]:
        """Mark `camera` watched for the duration; the last watcher to leave frees its frame."""
        with self._lock:
            self._watchers[camera] += 1
        try:
            yield
        finally:
            with self._lock:
                self._watchers[camera] -= 1
                if self._watchers[camera] <= 0:
                    del self._watchers[camera]
                    self._latest.pop(camera, None)

    def watched(self, camera: str) -> bool:
        """True while somebody watches `camera`."""
        return bool(self._watchers.get(camera))

    def watchers(self) -> dict[str, int]:
        """Watchers per camera."""
        with self._lock:
            return dict(self._watchers)

    def latest(self, camera: str) -> Shot | None:
        """The newest shot of a watched camera, None before its first."""
        with self._lock:
            return self._latest.get(camera)

    def seq(self, camera: str) -> int:
        """The newest shot's seq of `camera` (0: none yet): `wait_next(camera, tap.seq(camera))` is the next frame."""
        with self._lock:
            shot = self._latest.get(camera)
            return shot.seq if shot is not None else 0

    def wait_next(self, camera: str, after_seq: int, timeout: float) -> Shot | None:
        """The newest shot of `camera` with a seq above `after_seq`, waiting up to `timeout`; None on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            cond = self._cond(camera)
            while True:
                shot = self._latest.get(camera)
                if shot is not None and shot.seq > after_seq:
                    return shot
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                cond.wait(left)

    def wake(self) -> None:
        """Wake every waiter (shutdown)."""
        with self._lock:
            for cond in self._conds.values():
                cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """Frames kept for watchers and skipped (nobody watched), watchers per camera."""
        return {"kept": self.kept, "skipped": self.skipped, "watchers": self.watchers()}

    @contextmanager
    def next_shot(self, camera: str, timeout: float) -> Iterator[Shot | None]:
        """Watch `camera` and yield its next frame (one captured after this call), None after `timeout`."""
        with self.watch(camera):
            yield self.wait_next(camera, self.seq(camera), timeout)
