"""One-slot freshest-frame mailbox between the camera and the inference worker.

A new frame replaces an unread one: the worker always gets the newest image, latency never piles up
behind a slow model, and every replaced frame is counted as dropped. `filled_at` is when the slot went
from empty to full; a replacing frame keeps it, so the batcher's timeout counts from the first frame
the slot held, not from the newest one (a steady camera cannot push a batch's deadline out forever).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class FreshestMailbox(Generic[T]):
    """Thread-safe single slot with drop counting."""

    def __init__(self, signal: threading.Condition | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._cond = threading.Condition()
        self._clock = clock
        self._filled_at: float | None = None  # when the slot went from empty to full; kept on a replace
        self._signal = signal  # shared by several mailboxes: one waiter (the batcher) watches them all
        self._item: T | None = None
        self._closed = False
        self.dropped = 0
        self.delivered = 0
        self._taken_at: float | None = None  # when the consumer last took an item (agent.pipeline.demand)

    def put(self, item: T) -> bool:
        """Store `item`; returns True when it replaced an unread one (a drop). Never blocks."""
        with self._cond:
            replaced = self._item is not None
            if replaced:
                self.dropped += 1
            else:
                self._filled_at = self._clock()
            self._item = item
            self._cond.notify()
        if self._signal is not None:
            with self._signal:
                self._signal.notify_all()
        return replaced

    def peek(self) -> T | None:
        """The unread item without taking it (None when empty)."""
        with self._cond:
            return self._item

    def peek_filled(self) -> tuple[T | None, float | None]:
        """The unread item and when the slot was filled (its first unread frame arrived); (None, None) when empty."""
        with self._cond:
            return self._item, self._filled_at

    def take(self) -> T | None:
        """The unread item, never waiting; None when empty."""
        with self._cond:
            item, self._item, self._filled_at = self._item, None, None
            if item is not None:
                self.delivered += 1
                self._taken_at = self._clock()
            return item

    def takes(self) -> tuple[int, float | None]:
        """(items taken so far, when the last was taken): the consumer's pace, for predictive decoding."""
        with self._cond:
            return self.delivered, self._taken_at

    def discard(self, item: T) -> bool:
        """Empty the slot if it holds exactly `item` (identity), counting a drop; True when it did.

        For a reader that served `item`'s content another way (agent.sources.lazy): checking and emptying
        under the mailbox's own lock means a put between them cannot be lost, and the counters are only
        ever written under that lock.
        """
        with self._cond:
            if self._item is not item or item is None:
                return False
            self._item, self._filled_at = None, None
            self.dropped += 1
            return True

    def get(self, timeout: float | None = None) -> T | None:
        """Newest item, waiting up to `timeout`; None on timeout or after close()."""
        with self._cond:
            if self._item is None and not self._closed:
                self._cond.wait(timeout)
            return self.take()  # the Condition's lock is re-entrant

    def close(self) -> None:
        """Wake any waiter; later gets return what is left, then None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._signal is not None:
            with self._signal:
                self._signal.notify_all()

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._closed
