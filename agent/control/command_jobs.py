"""Handlers run on threads of their own, so a handler stuck on the state database cannot hold the reply back.

The dispatcher (agent.control.commands) starts each handler as a `Job` and waits for it. A handler that is not
done within `check_s` while another process holds the state database's write lock is left running: the sender
is answered BUSY at once, and the handler's own reply, when it comes, is remembered under the request's id (a
retry with the same id gets it). Without such a lock the dispatcher waits as long as the handler takes (a rollback
swaps models, a snapshot waits for a frame), as it always did.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

Reply = dict[str, Any]


class Job:
    """One handler call on its own thread; `detach(then)` hands its reply to `then` instead of the waiter."""

    def __init__(self, run: Callable[[], Reply], name: str, on_end: Callable[[], None]) -> None:
        self._run, self._on_end = run, on_end
        self.done = threading.Event()
        self.reply: Reply | None = None
        self._then: Callable[[Reply | None], None] | None = None
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        reply: Reply | None = None
        try:
            reply = self._run()  # the dispatcher's _call: it turns every Exception into a reply
        finally:  # a handler that raised past that (SystemExit) still ends its job, with no reply (None)
            self._on_end()
            with self._lock:
                self.reply, then = reply, self._then
                self.done.set()
            if then is not None:
                then(reply)

    def detach(self, then: Callable[[Reply | None], None]) -> bool:
        """Give the reply to `then` when it comes; False (nothing registered) when it is already there."""
        with self._lock:
            if self.done.is_set():
                return False
            self._then = then
            return True


class Jobs:
    """Starts jobs, at most `limit` running at once (the rest are refused: the caller answers BUSY)."""

    def __init__(self, limit: int = 8) -> None:
        self.limit, self._running, self._lock = limit, 0, threading.Lock()

    @property
    def running(self) -> int:
        """Handlers running now (waited for, or left running past a locked database)."""
        return self._running

    def start(self, run: Callable[[], Reply], name: str) -> Job | None:
        """Start `run` on a new thread; None when `limit` handlers run already."""
        with self._lock:
            if self._running >= self.limit:
                return None
            self._running += 1
        job = Job(run, name, self._ended)
        job.thread.start()
        return job

    def _ended(self) -> None:
        with self._lock:
            self._running -= 1


def wait(job: Job, check_s: float, storage_locked: Callable[[], bool]) -> bool:
    """Wait for `job`; True when it finished, False when it still runs after `check_s` while `storage_locked()`."""
    while not job.done.wait(check_s):
        if storage_locked():
            return job.done.is_set()
    return True
