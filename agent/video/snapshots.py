"""Snapshots: one annotated JPEG of a camera, on the MQTT `snapshot` command or every `snapshot_interval_s`.

A snapshot waits for the camera's next frame (the tap keeps none while nobody watches), draws it, and lowers
JPEG quality, then size, until it fits `snapshot_max_bytes`. One camera is snapshotted at most every
`snapshot_min_interval_s`; more are refused with RATE_LIMITED, never queued. Publishing is the caller's
(`publish(camera, payload) -> bool`): the MQTT plane sends it at QoS 1 while connected, and a snapshot is not
kept for later — an old picture is not what an operator asked for.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from agent.video.config import VideoConfig
from agent.video.encode import JpegEncoder, encode_jpeg, fit_width
from agent.video.snapshot_wire import Snapshot
from agent.video.tap import FrameTap
from kernel.errors import EdgeError

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], bool]
_LOWER_QUALITIES = (70, 55, 40, 25)  # tried after the configured quality, those below it


class Snapshotter:
    """Takes and publishes snapshots; `take` for one, `start` for the periodic ones."""

    def __init__(self, config: VideoConfig, tap: FrameTap, encoder: JpegEncoder, device_id: str, cameras: list[str],
                 publish: Publish | None, stop: threading.Event) -> None:
        self.config, self.tap, self.encoder = config, tap, encoder
        self.device_id, self.cameras = device_id, list(cameras)
        self.publish = publish
        self.stop_event = stop
        self._last: dict[tuple[str, str], float] = {}  # (camera, reason) -> when it was last taken
        self._lock = threading.Lock()
        self.taken = 0
        self.published = 0
        self.unsent = 0
        self.refused = 0
        self._thread: threading.Thread | None = None

    def take(self, camera: str | None = None, overlay: bool = True, request_id: str | None = None,
             reason: str = "command") -> Snapshot:
        """A snapshot of `camera` (default: the first) from its next frame, rate-limited per camera (commands and
        periodic snapshots each in their own slot: a periodic one never refuses an operator's command); EdgeError
        with a code when none can be had."""
        name = camera or self.cameras[0]
        if name not in self.cameras:
            raise EdgeError(f"no camera {name!r}; cameras: {', '.join(self.cameras)}", code="INVALID_COMMAND")
        now = time.monotonic()
        with self._lock:
            last = self._last.get((name, reason))
            if reason == "command" and last is not None and now - last < self.config.snapshot_min_interval_s:
                self.refused += 1
                raise EdgeError(f"camera {name!r} was snapshotted {now - last:.1f} s ago; at most one every "
                                f"{self.config.snapshot_min_interval_s:g} s (video.snapshot_min_interval_s)",
                                code="RATE_LIMITED")
            self._last[(name, reason)] = now
        with self.tap.next_shot(name, self.config.snapshot_wait_s) as shot:
            pass
        if shot is None:
            raise EdgeError(f"camera {name!r} delivered no frame within {self.config.snapshot_wait_s:g} s "
                            "(video.snapshot_wait_s)", code="VIDEO_UNAVAILABLE")
        jpeg, (height, width) = fit_jpeg(self.encoder.picture(shot, overlay), self.config.quality,
                                         self.config.snapshot_max_bytes, self.encoder)
        self.taken += 1
        return Snapshot(self.device_id, name, jpeg, time.time(), shot.captured_wall, shot.frame_index, width, height,
                        overlay, reason, request_id, shot.style.label or None)

    def send(self, snapshot: Snapshot) -> bool:
        """Publish it; False when there is no broker connection (nothing is kept for later)."""
        sent = bool(self.publish and self.publish(snapshot.camera, json.dumps(snapshot.to_payload()).encode()))
        if sent:
            self.published += 1
        else:
            self.unsent += 1
        return sent

    def start(self) -> None:
        """Periodic snapshots of every camera, when `snapshot_interval_s` is set (and snapshots are on)."""
        if self.config.snapshots and self.config.snapshot_interval_s > 0 and self.publish is not None:
            self._thread = threading.Thread(target=self._periodic, name="video-snapshots", daemon=True)
            self._thread.start()

    def _periodic(self) -> None:
        while not self.stop_event.wait(self.config.snapshot_interval_s):
            for camera in self.cameras:
                if self.stop_event.is_set():  # each camera may wait snapshot_wait_s: never past a stop
                    return
                try:
                    self.send(self.take(camera, self.config.overlay, reason="periodic"))
                except EdgeError as exc:
                    log.info("periodic snapshot of %s skipped: %s", camera, exc)
                except Exception:
                    log.exception("periodic snapshot of %s failed", camera)

    def join(self, timeout: float) -> None:
        """Wait for the periodic thread after a stop (VideoService.stop sets the event and wakes the tap first)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        """Snapshots taken, published, unsent (no broker) and refused (rate limit)."""
        return {"taken": self.taken, "published": self.published, "unsent": self.unsent, "refused": self.refused}


def fit_jpeg(picture: np.ndarray, quality: int, max_bytes: int,
             counter: JpegEncoder | None = None) -> tuple[bytes, tuple[int, int]]:
    """The largest, best JPEG of `picture` within `max_bytes`, and its (height, width): lower quality first,
    then halve the size."""
    while True:
        for q in (quality, *(q for q in _LOWER_QUALITIES if q < quality)):
            data = encode_jpeg(picture, q, counter)
            if len(data) <= max_bytes:
                return data, (picture.shape[0], picture.shape[1])
        if picture.shape[1] <= 64:
            raise EdgeError(
                f"a snapshot does not fit in {max_bytes} bytes even at 64 px wide", code="VIDEO_UNAVAILABLE"
            )
        picture = fit_width(picture, max(64, picture.shape[1] // 2))
