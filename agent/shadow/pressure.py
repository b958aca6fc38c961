"""When the shadow must yield: the serving model comes first. Checked for every frame the shadow would take,
on the results thread, from numbers the agent already keeps (no I/O)."""

from __future__ import annotations

import time
from typing import Callable

from agent.adapt.inputs import SlidingLatency

RECHECK_S = (
    0.1  # the verdict is kept this long: sorting the window for every sampled frame would cost the results thread
)
YIELD_RATIO = 0.9  # of the serving model's latency budget: the shadow steps aside before the budget breaks
WINDOW_S = 3.0


class ServingPressure:
    """The serving model's recent p99 (glass to result), device throttling and the adaptive policy's limits."""

    def __init__(self, yield_p99_ms: float | None, throttled: Callable[[], bool] = lambda: False,
                 adapt_over_limit: Callable[[], bool] = lambda: False) -> None:
        self.yield_p99_ms = yield_p99_ms
        self.latency = SlidingLatency(WINDOW_S)
        self._throttled, self._adapt_over_limit = throttled, adapt_over_limit
        self._checked: tuple[float, str | None] = (-RECHECK_S, None)

    def record(self, latency_ms: float, now: float) -> None:
        """One serving-model frame (every frame, sampled or not: the p99 is the serving model's)."""
        self.latency.record(latency_ms, now)

    def p99(self, now: float | None = None) -> float | None:
        """The serving model's p99 over the last few seconds."""
        return self.latency.p99(time.monotonic() if now is None else now)

    def reason(self, now: float) -> str | None:
        """Why the shadow must skip a frame now (`budget`, `throttled`, `adapt_limit`), or None."""
        at, reason = self._checked
        if now - at < RECHECK_S:
            return reason
        reason = self._reason(now)
        self._checked = (now, reason)
        return reason

    def _reason(self, now: float) -> str | None:
        if self.yield_p99_ms is not None:
            p99 = self.latency.p99(now)
            if p99 is not None and p99 >= self.yield_p99_ms:
                return "budget"
        if self._throttled():
            return "throttled"
        if self._adapt_over_limit():
            return "adapt_limit"
        return None


def yield_threshold(configured_ms: float | None, budget_ms: float | None) -> float | None:
    """The serving p99 at which the shadow yields: the configured one, else YIELD_RATIO of the serving model's
    latency budget, else none (the other signals still apply)."""
    if configured_ms is not None:
        return configured_ms
    return None if budget_ms is None else YIELD_RATIO * budget_ms


class TimeShare:
    """The candidate's running time held to `share` of the wall clock (a token bucket of seconds).

    `share` is a share of frames; a candidate that costs more per frame than the serving model would take more of
    the device than that. Measured on a 2-core CPU: the demo's INT8 build at share 0.1 ran 38 ms a frame beside a
    14 ms serving model, about 27 % of a core. With this bound it runs at most `share` of the time (100 ms a
    second at 0.1) and the frames beyond it are skipped as `cost`: the serving fps came back by 1-3 % (the p99
    cost of overlapping at all stayed; docs/deployments.md). A candidate as cheap as the serving model never
    meets it: at share 0.1 it is busy 0.1 x the serving model's own busy time."""

    def __init__(self, share: float, burst_s: float = 1.0) -> None:
        self.share = share
        self.capacity = share * burst_s
        self._tokens = self.capacity  # written by the results thread only
        self._at: float | None = None
        # written by the shadow thread only, read by the results thread: no lock the frame path could wait on
        # while a SCHED_IDLE thread that holds it waits for a core
        self._spent = 0.0
        self._spent_seen = 0.0

    def allows(self, now: float) -> bool:
        """Whether the candidate may take another frame now (the results thread)."""
        spent = self._spent
        self._tokens -= spent - self._spent_seen
        self._spent_seen = spent
        if self._at is not None:
            self._tokens = min(self.capacity, self._tokens + self.share * (now - self._at))
        self._at = now
        return self._tokens > 0

    def spend(self, seconds: float) -> None:
        """The candidate ran a frame for `seconds` (the shadow thread); a long one is paid back before the next."""
        self._spent += seconds
