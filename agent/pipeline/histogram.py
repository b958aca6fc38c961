"""Bounded latency histograms: constant memory however long the agent runs.

Log-spaced buckets (2 % wide) from 10 µs to 100 s: percentiles are exact to within one bucket,
which is far below the jitter of any real frame path. Max, count and sum are exact.
"""

from __future__ import annotations

import math
import threading

_MIN_MS = 0.01
_GROWTH = 1.02
_BUCKETS = int(math.log(100_000 / _MIN_MS) / math.log(_GROWTH)) + 2
_LOG_GROWTH = math.log(_GROWTH)


class LatencyHistogram:
    """Milliseconds in, p50/p95/p99/max out."""

    def __init__(self) -> None:
        self._counts = [0] * _BUCKETS
        self._lock = threading.Lock()
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    @staticmethod
    def _bucket(ms: float) -> int:
        if ms <= _MIN_MS:
            return 0
        return min(_BUCKETS - 1, int(math.log(ms / _MIN_MS) / _LOG_GROWTH) + 1)

    def record(self, ms: float) -> None:
        """Add one sample."""
        with self._lock:
            self._counts[self._bucket(ms)] += 1
            self.count += 1
            self.total += ms
            if ms > self.max:
                self.max = ms

    def percentile(self, q: float) -> float | None:
        """Upper edge of the bucket holding the q-th percentile (capped at the exact max)."""
        with self._lock:
            if self.count == 0:
                return None
            rank = max(1, math.ceil(q / 100 * self.count))
            seen = 0
            for index, n in enumerate(self._counts):
                seen += n
                if seen >= rank:
                    return min(_MIN_MS * _GROWTH**index, self.max)
        return self.max

    @property
    def mean(self) -> float | None:
        """Arithmetic mean, None when empty."""
        return self.total / self.count if self.count else None

    def summary(self) -> dict[str, float]:
        """`{"p50","p95","p99","max"}` rounded to 0.1 ms; empty dict when no samples."""
        if self.count == 0:
            return {}
        out = {f"p{q}": round(self.percentile(q) or 0.0, 1) for q in (50, 95, 99)}
        out["max"] = round(self.max, 1)
        return out

    def merge(self, other: "LatencyHistogram") -> None:
        """Add another histogram's samples (same bucket layout)."""
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, other._counts)]
            self.count += other.count
            self.total += other.total
            self.max = max(self.max, other.max)

    def reset(self) -> None:
        """Forget all samples (a new watch window)."""
        with self._lock:
            self._counts = [0] * _BUCKETS
            self.count, self.total, self.max = 0, 0.0, 0.0
