"""Pacing for downloads: a token bucket for the bandwidth cap, and progress events at a bounded rate."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kernel.errors import EdgeError

log = logging.getLogger(__name__)
ProgressCallback = Callable[[dict], None]


class TokenBucket:
    """Caps the average rate at `rate` bytes/s with bursts of at most `capacity` bytes."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.capacity, self.clock = rate, capacity, clock
        self.tokens, self.stamp = capacity, clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def consume(self, amount: int, stop: threading.Event) -> None:
        """Take `amount` bytes' worth of tokens, sleeping (interruptibly) while in deficit."""
        self._refill()
        deficit = amount - self.tokens
        if deficit > 0:
            if stop.wait(deficit / self.rate):
                raise cancelled()
            self._refill()
        self.tokens -= amount


class Progress:
    """Turns byte counts into `fetching` events, a few per second at most (and one at each file's end)."""

    def __init__(self, callback: ProgressCallback | None, total: int, interval_s: float = 0.25) -> None:
        self.callback, self.total, self.interval_s = callback, total, interval_s
        self.done_before = 0  # bytes of finished files
        self.last_emit = 0.0
        self.window: tuple[float, int] = (time.monotonic(), 0)
        self.rate_bps = 0.0

    def update(self, name: str, have: int, size: int, final: bool = False) -> None:
        """Report `have` of `size` bytes of file `name`; rate_bps is bits per second over the last window."""
        now = time.monotonic()
        if now - self.last_emit < self.interval_s and not final:
            return
        since, base = self.window
        if now - since >= self.interval_s:
            self.rate_bps = max(0.0, (self.done_before + have - base) * 8 / (now - since))
            self.window = (now, self.done_before + have)
        self.last_emit = now
        event = {
            "stage": "fetching", "file": name, "bytes": have, "total": size, "rate_bps": round(self.rate_bps),
            "artifact_bytes": self.done_before + have, "artifact_total": self.total,
        }
        if final:
            self.done_before += size
        if self.callback is not None:
            try:
                self.callback(event)
            except Exception:  # a broken observer must not break a download; it is logged, not hidden
                log.exception("progress callback failed")


def cancelled() -> EdgeError:
    """The error for a download stopped by the stop event (the partial data stays for a resume)."""
    return EdgeError("artifact download cancelled (agent stopping)", code="ARTIFACT_FETCH_CANCELLED")
