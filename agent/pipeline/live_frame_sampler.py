"""A rolling sample of what this device's cameras see, for the gates (`[gates] live_frames = N`).

The result sink offers every delivered frame; at most one per camera every `interval_s` is kept. `offer`
never waits: it copies the image and hands it to a writer thread through a one-slot queue (a busy writer
means the frame is skipped, not queued). The writer encodes a PNG, writes it with temp file + fsync +
rename into `<state_dir>/live-frames/` (engines.evaluation.live_frames reads it), then drops the oldest frames past
`max_frames` or `max_bytes`. A full or read-only disk costs the sample, never the frame path or the agent.
The frames stay on the device: nothing here is published.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from pathlib import Path
from typing import Callable

import cv2
import numpy as np

from kernel.fsutil import atomic_write_bytes
from engines.evaluation.live_frames import sample_files

log = logging.getLogger(__name__)


class LiveFrameSampler:
    """Keeps the newest `max_frames` sampled camera frames (and at most `max_bytes`) in `directory`."""

    def __init__(self, directory: Path, max_frames: int, max_bytes: int, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = Path(directory)
        self.max_frames, self.max_bytes, self.interval_s = max_frames, max_bytes, interval_s
        self.clock = clock
        self.written = self.skipped = self.errors = 0
        self._last: dict[str, float] = {}
        self._queue: queue.Queue[tuple[str, np.ndarray, float] | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, name="live-frames", daemon=True)
        self._started = False

    def start(self) -> None:
        """Start the writer thread."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._started = True
        self._thread.start()

    def offer(self, camera: str, image: np.ndarray | None) -> bool:
        """Sample this frame if its camera is due (frame path: never blocks); True when taken."""
        now = self.clock()
        last = self._last.get(camera)
        if not self._started or (last is not None and now - last < self.interval_s):
            return False
        if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            return False
        try:
            self._queue.put_nowait((camera, image.copy(), time.time()))
        except queue.Full:
            self.skipped += 1
            return False
        self._last[camera] = now
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Finish the frame being written and stop."""
        if not self._started:
            return
        self._started = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def stats(self) -> dict[str, int]:
        """What the sample holds and what it cost (for status)."""
        files = sample_files(self.directory)
        return {"frames": len(files), "written": self.written, "skipped": self.skipped, "errors": self.errors}

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._write(*item)
                self.written += 1
            except (OSError, cv2.error) as exc:
                self.errors += 1
                if self.errors in (1, 10, 100) or self.errors % 1000 == 0:
                    log.warning("live frame sample: could not write a frame (%d so far): %s", self.errors, exc)

    def _write(self, camera: str, image: np.ndarray, wall: float) -> None:
        ok, encoded = cv2.imencode(".png", image)
        if not ok:
            raise OSError("PNG encoding failed")
        name = f"{int(wall * 1000):013d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', camera)[:64]}.png"
        atomic_write_bytes(self.directory / name, encoded.tobytes())  # temp file, fsync, rename, fsync the dir
        self._prune()

    def _prune(self) -> None:
        files = sample_files(self.directory)
        sizes = {}
        for path in files:
            try:
                sizes[path] = path.stat().st_size
            except FileNotFoundError:
                pass
        kept = [p for p in files if p in sizes]
        total = sum(sizes.values())
        while kept and (len(kept) > self.max_frames or total > self.max_bytes):
            oldest = kept.pop(0)
            total -= sizes[oldest]
            oldest.unlink(missing_ok=True)
