"""A sliding-window rate limiter (the per-command, per-channel limits of agent.control.commands)."""

from __future__ import annotations

import collections
import threading
import time


class RateLimit:
    """At most `limit` events per sliding `window_s` (limit 0: no limit); thread-safe."""

    def __init__(self, limit: int, window_s: float = 60.0) -> None:
        self.limit, self.window_s = limit, window_s
        self._times: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()

    def take(self) -> float:
        """Count one event and return 0, or return the seconds until one is allowed (nothing counted)."""
        if self.limit <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            while self._times and now - self._times[0] >= self.window_s:
                self._times.popleft()
            if len(self._times) >= self.limit:
                return max(0.001, self.window_s - (now - self._times[0]))
            self._times.append(now)
            return 0.0

    def refund(self) -> None:
        """Give back the newest event: a request refused before it did any work does not count."""
        with self._lock:
            if self._times:
                self._times.pop()
