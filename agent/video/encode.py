"""Shots to JPEG: drawn and encoded once per frame and variant, however many viewers want it.

Every viewer of a camera asks for the newest shot; the first to ask draws and encodes it, the others get the
same bytes (a cache of one entry per camera and variant). Costs are measured here, where they are paid.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import cv2
import numpy as np

from agent.pipeline.histogram import LatencyHistogram
from agent.video.overlay import render
from agent.video.tap import Shot


class JpegEncoder:
    """`jpeg(shot, overlay)` -> bytes, cached per (camera, overlay) for the newest seq."""

    def __init__(self, quality: int = 80, max_width: int = 1280) -> None:
        self.quality = quality
        self.max_width = max_width
        self._cache: dict[tuple[str, bool], tuple[int, bytes]] = {}
        self._locks: defaultdict[tuple[str, bool], threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()
        self.draws = 0
        self.encodes = 0
        self.encoded_bytes = 0
        self.draw_ms = LatencyHistogram()
        self.encode_ms = LatencyHistogram()

    def jpeg(self, shot: Shot, overlay: bool) -> bytes:
        """The shot as JPEG at the configured quality (drawn when `overlay`)."""
        key = (shot.camera, overlay)
        with self._guard:
            lock = self._locks[key]
        with lock:  # a second viewer waits for the first one's encode instead of doing it again
            cached = self._cache.get(key)
            if cached is not None and cached[0] == shot.seq:
                return cached[1]
            data = encode_jpeg(self.picture(shot, overlay), self.quality, self)
            self._cache[key] = (shot.seq, data)
            return data

    def picture(self, shot: Shot, overlay: bool, max_width: int | None = None) -> np.ndarray:
        """The BGR picture to show for `shot`, scaled down to `max_width` (default: the configured one)."""
        start = time.perf_counter()
        picture = render(shot.image, shot.result, shot.style, overlay, caption=shot.camera, tracking=shot.tracking)
        with self._guard:
            self.draws += 1
        self.draw_ms.record((time.perf_counter() - start) * 1e3)
        return fit_width(picture, max_width or self.max_width)

    def counted(self, size: int, ms: float) -> None:
        """One encode of `size` bytes that took `ms` (viewers, streams and snapshots encode on their own threads)."""
        with self._guard:
            self.encodes += 1
            self.encoded_bytes += size
        self.encode_ms.record(ms)

    def stats(self) -> dict[str, Any]:
        """Draws and encodes done, bytes per frame, their costs (ms)."""
        return {"draws": self.draws, "encodes": self.encodes,
                "bytes_per_frame": round(self.encoded_bytes / self.encodes) if self.encodes else None,
                "draw_ms": self.draw_ms.summary(), "encode_ms": self.encode_ms.summary()}


def fit_width(picture: np.ndarray, max_width: int) -> np.ndarray:
    """`picture` scaled down (aspect kept) when wider than `max_width`."""
    height, width = picture.shape[:2]
    if width <= max_width:
        return picture
    size = (max_width, max(1, round(height * max_width / width)))
    return cv2.resize(picture, size, interpolation=cv2.INTER_AREA)


def encode_jpeg(picture: np.ndarray, quality: int, counter: JpegEncoder | None = None) -> bytes:
    """JPEG bytes of a BGR picture; counted and timed on `counter`."""
    start = time.perf_counter()
    ok, buffer = cv2.imencode(".jpg", picture, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise ValueError(f"JPEG encoding failed for a {picture.shape} picture")
    data = buffer.tobytes()
    if counter is not None:
        counter.counted(len(data), (time.perf_counter() - start) * 1e3)
    return data
