"""The batcher: the newest unprocessed frame of each ready camera, up to `max_size`, in one engine call.

Semantics follow DeepStream's `nvstreammux`:
- a batch holds at most one frame per camera: the newest one in that camera's mailbox (older ones were
  already replaced there and counted as drops);
- it is sent when it is full (`max_size` cameras ready, or every live camera ready when fewer live
  cameras than `max_size` remain) or when `timeout_s` has passed since its first frame arrived: the
  deadline is the oldest time one of its mailboxes went from empty to full (a frame that replaces an
  unread one keeps that time), so a camera that is late, lost or silent never holds the others back
  longer than that, however often the others replace their frames;
- with more ready cameras than `max_size`, the start of the camera order rotates past the last camera
  taken, so every camera gets its turn (no starving);
- a lost camera simply has no frame: it stops joining batches and joins again once it delivers.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Generic, Sequence, TypeVar

from agent.pipeline.mailbox import FreshestMailbox

T = TypeVar("T")  # what the mailboxes hold: camera frames on the frame path, results on the MQTT plane

Clock = Callable[[], float]


class Batcher(Generic[T]):
    """Takes batches out of per-camera mailboxes that share one wake-up condition."""

    def __init__(self, names: Sequence[str], max_size: int, timeout_s: float,
                 is_live: Callable[[str], bool] | None = None, clock: Clock = time.monotonic) -> None:
        if not names:
            raise ValueError("the batcher needs at least one camera")
        if max_size < 1:
            raise ValueError(f"batch max_size must be >= 1, got {max_size}")
        self.names = list(names)
        self.max_size = max_size
        self.timeout_s = timeout_s
        self.signal = threading.Condition()
        self.mailboxes: dict[str, FreshestMailbox[T]] = {n: FreshestMailbox(self.signal, clock) for n in self.names}
        self.is_live = is_live or (lambda name: True)
        self.clock = clock
        self._start = 0  # index in `names` where the next batch starts looking

    def mailbox(self, name: str) -> FreshestMailbox[T]:
        """The mailbox the capture thread of camera `name` puts into."""
        return self.mailboxes[name]

    @property
    def dropped(self) -> int:
        """Frames replaced unread, all cameras."""
        return sum(m.dropped for m in self.mailboxes.values())

    def close(self) -> None:
        """Wake the waiting worker; later calls return what is left, then empty batches."""
        for mailbox in self.mailboxes.values():
            mailbox.close()

    def next_batch(self, stop: threading.Event, idle_s: float = 0.2) -> list[T]:
        """Wait for a batch (full or timed out); [] after `idle_s` without any frame, or when stopping."""
        idle_deadline = self.clock() + idle_s
        with self.signal:
            while not stop.is_set():
                ready = self._ready()
                if ready:
                    wait = self._wait_left(ready)
                    if wait <= 0:
                        return self._take(ready)
                elif self._all_closed():
                    return []
                else:
                    wait = idle_deadline - self.clock()
                    if wait <= 0:
                        return []
                self.signal.wait(wait)
        return []

    def _ready(self) -> list[tuple[int, T, float]]:
        """(camera index, newest frame, when its mailbox was filled) of cameras with an unread frame."""
        out = []
        for i, name in enumerate(self.names):
            frame, filled_at = self.mailboxes[name].peek_filled()
            if frame is not None:
                out.append((i, frame, filled_at if filled_at is not None else self.clock()))
        return out

    def _target(self) -> int:
        live = sum(1 for name in self.names if self.is_live(name))
        return max(1, min(self.max_size, live))

    def _wait_left(self, ready: list[tuple[int, T, float]]) -> float:
        """Seconds to wait for more cameras; <= 0 means send now. The deadline counts from the oldest fill
        time, which a replaced frame does not move (nvstreammux: timeout since the batch's first frame)."""
        if len(ready) >= self._target():
            return 0.0
        first = min(filled_at for _, _, filled_at in ready)
        return first + self.timeout_s - self.clock()

    def _take(self, ready: list[tuple[int, T, float]]) -> list[T]:
        """Up to max_size ready cameras in rotated order; the next batch starts after the last one taken."""
        n = len(self.names)
        order = sorted(ready, key=lambda item: (item[0] - self._start) % n)[: self.max_size]
        batch = []
        for index, _, _ in order:
            frame = self.mailboxes[self.names[index]].take()
            if frame is not None:  # taken since the peek only by us: the worker is the one reader
                batch.append(frame)
        self._start = (order[-1][0] + 1) % n
        return batch

    def _all_closed(self) -> bool:
        return all(m.closed for m in self.mailboxes.values())
