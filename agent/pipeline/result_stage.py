"""Finish batch k on its own thread while the engine runs batch k+1.

Postprocessing, stats and result delivery are CPU work that the engine call does not need: on a Jetson the
engine runs on the GPU and the CPU idles during it; on a CPU engine, part of every call is single-threaded
and leaves a core free. The stage takes one batch at a time and the worker hands it the next one only when
it is idle again, so results keep their order, at most one batch waits for its results, and a slow sink
slows the worker (and the systemd watchdog sees it) instead of queueing frames that only get older.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class ResultStage(threading.Thread, Generic[T]):
    """Runs `handle(item)` for each submitted item, in order, on this thread."""

    def __init__(self, handle: Callable[[T], None], name: str = "results") -> None:
        super().__init__(name=name, daemon=True)
        self._handle = handle
        self._cond = threading.Condition()
        self._item: list[T] = []  # 0 or 1 item waiting to be taken
        self._submitted = 0
        self._handled = 0
        self._closed = False

    def submit(self, item: T) -> None:
        """Hand over `item` once every earlier item is handled (backpressure); handled inline when the stage
        is not running (not started, closed, or gone), so no batch is ever left without its results."""
        with self._cond:
            while self._handled < self._submitted and self.is_alive():
                self._cond.wait(0.5)
            if self.is_alive() and not self._closed:
                self._item.append(item)
                self._submitted += 1
                self._cond.notify_all()
                return
        self._run_one(item)

    @property
    def submitted(self) -> int:
        """Items handed over so far (a mark for `wait_handled`)."""
        with self._cond:
            return self._submitted

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted item is handled; False on timeout."""
        return self.wait_handled(None, timeout)

    def wait_handled(self, mark: int | None, timeout: float | None = None) -> bool:
        """Wait until the first `mark` items submitted (None: all submitted by then) are handled; False on timeout.
        A mark does not chase items submitted later, so a busy stage cannot keep the caller waiting."""
        with self._cond:
            target = self._submitted if mark is None else mark
            return self._cond.wait_for(lambda: self._handled >= target or not self.is_alive(), timeout)

    def close(self, timeout: float | None = None) -> None:
        """Handle what was submitted, then end the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
        if not self.is_alive():  # a stage that ended with an item still waiting: that item gets its results here
            with self._cond:
                left, self._item = self._item, []
            for item in left:
                self._run_one(item)

    def run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._item or self._closed)
                if not self._item:
                    return
                item = self._item.pop()
            try:
                self._run_one(item)
            finally:
                with self._cond:
                    self._handled += 1
                    self._cond.notify_all()

    def _run_one(self, item: T) -> None:
        try:
            self._handle(item)
        except BaseException:  # the handler reports its own failures; this thread must outlive a bug in one
            log.exception("%s: finishing a batch failed", self.name)
