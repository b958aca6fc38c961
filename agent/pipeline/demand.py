"""Will the consumer take a frame before the next grab? Decides whether a live camera's grab is retrieved.

A live source (V4L2, FFmpeg, GStreamer) blocks in `grab` until the next frame arrives, so its retrieve
(decode or colour conversion, and the copy) cannot wait for the consumer: the capture thread must
decide right after each grab. It retrieves when the consumer is expected to take a frame before the
next grab completes; otherwise the grab is skipped and costs only the grab.

The estimator is pure (times in, decision out): it keeps exponentially weighted means of the interval
between the consumer's takes, between grabs, and of how long a retrieve takes. The next take is
expected at `last_take + take_interval`, the next grab at `now + grab_interval`; the grab is
retrieved when the take is due before the next grab's frame could be ready (`+ margin`, the retrieve
time). A take already overdue (the consumer is waiting, or busy past its usual interval) is always
"before the next grab". With no history yet every grab is retrieved.

Why the margin is only a retrieve long: a take that comes earlier than predicted finds no frame and
waits for the next grab's retrieve -- a wait no longer than its own earliness -- while a wider margin
retrieves two grabs for every take it covers. A consumer that takes right after a put (a batcher
woken by the frame) takes in step with the grabs, and a margin of a fixed fraction of a grab would
decode two frames per take for it.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SMOOTHING = 0.2  # weight of a new sample: adapts in a few frames, one late batch moves it little


def take_due_before_next_grab(
    now: float, last_take: float, take_interval: float, grab_interval: float, margin_s: float = 0.0
) -> bool:
    """True when the next take (`last_take + take_interval`) comes before the next grab plus `margin_s`."""
    return last_take + take_interval <= now + grab_interval + margin_s


@dataclass
class DemandEstimator:
    """EWMA of take and grab intervals and retrieve time for one camera; `should_retrieve` after each grab."""

    smoothing: float = DEFAULT_SMOOTHING
    take_interval: float | None = None
    grab_interval: float | None = None
    retrieve_s: float | None = None  # the margin: how long after its grab a retrieved frame is ready
    last_take: float | None = None
    last_grab: float | None = None
    _takes: int = 0  # the mailbox's cumulative take count when last observed

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    def observe_takes(self, takes: int, last_take_at: float | None) -> None:
        """The mailbox's take count and last take time; several takes since the last call count as their mean."""
        new = takes - self._takes
        if new <= 0 or last_take_at is None:
            return
        if self.last_take is not None and last_take_at > self.last_take:
            self.take_interval = self._mean(self.take_interval, (last_take_at - self.last_take) / new)
        self._takes, self.last_take = takes, last_take_at

    def observe_grab(self, at: float) -> None:
        """A grab completed at `at`."""
        if self.last_grab is not None and at > self.last_grab:
            self.grab_interval = self._mean(self.grab_interval, at - self.last_grab)
        self.last_grab = at

    def observe_retrieve(self, seconds: float) -> None:
        """A retrieve took `seconds`."""
        self.retrieve_s = self._mean(self.retrieve_s, max(seconds, 0.0))

    def should_retrieve(self, now: float) -> bool:
        """Retrieve the grab that just completed? True without enough history to predict."""
        if self.take_interval is None or self.grab_interval is None or self.last_take is None:
            return True
        return take_due_before_next_grab(now, self.last_take, self.take_interval, self.grab_interval,
                                         self.retrieve_s or 0.0)

    def _mean(self, mean: float | None, sample: float) -> float:
        return sample if mean is None else mean + self.smoothing * (sample - mean)
