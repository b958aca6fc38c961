"""Writes to the state store that must never take the agent down, and the record of the ones that failed.

Another process holding `state.db`'s write lock past the busy timeout, an I/O error or a full disk makes a
write raise `sqlite3.OperationalError` (or OSError). Inference needs no disk, so such a write is isolated
(`StorageHealth.guard`): it is logged once per outage, counted, the agent's health turns `degraded`, a
`storage_degraded` event goes out (to MQTT even when it cannot be stored), and the next write that
succeeds ends the outage with `storage_recovered` and the numbers (issue 19).

Writes that must land but can wait (issue 47) go through `StorageHealth.defer`: the records a start makes
(the run, the backend choice, the active model) and every event. One is written at once when the store takes
it; otherwise it is kept, in order, in memory and retried in the background with backoff (1 s doubling to
30 s) until it lands, so a backup or an operator's sqlite3 holding the lock, or a full disk, delays the
record instead of ending the agent. While writes wait, later ones queue behind them (no second wait on the
lock); at most MAX_WAITING_EVENTS events wait, the oldest beyond that are dropped and counted. `status()`
says what waits and when the next try is. A write that fails because the disk is full also reports
`storage_full` (code STORAGE_FULL, bytes free) once per outage.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

log = logging.getLogger(__name__)

STORAGE_ERRORS = (sqlite3.Error, OSError)

EventSink = Callable[..., None]


RECLAIM_INTERVAL_S = 60.0  # a full disk is reclaimed from at most this often
RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0  # waiting writes are tried again after 1, 2, 4 ... 30 s
MAX_WAITING_EVENTS = 1000  # events kept for a later write; beyond, the oldest go (counted as `unrecorded_events`)
STOP_JOIN_S = 5.0


def disk_full(exc: BaseException) -> bool:
    """SQLite's "database or disk is full" (SQLITE_FULL), or an OSError ENOSPC / EDQUOT."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "disk is full" in str(exc) or getattr(exc, "sqlite_errorname", "") == "SQLITE_FULL"


class StatusLine(Protocol):
    """The two calls StartWaits makes of agent.base.sdnotify.Notifier."""

    def status(self, text: str) -> bool: ...

    def extend_timeout(self, seconds: float) -> bool: ...


class StartWaits:
    """How a start waits out a state store it cannot use yet: the log says why and when it tries again, systemd's
    status line says what it waits for (its start timeout extended past each wait), a full disk is shed from."""

    def __init__(self, health: "StorageHealth", stop: threading.Event, notifier: StatusLine) -> None:
        self.health, self.stop, self.notifier = health, stop, notifier

    def say(self, message: str, delay: float) -> None:
        """`message` starts with its code (STORAGE_FULL, STATE_STORE) or with what waits."""
        log.error("%s; the agent waits and tries again in %.0f s", message, delay)
        self.notifier.status(f"waiting for the state store: {message.split(':', 1)[0]}")
        self.notifier.extend_timeout(delay + 60)

    def until_done(self, what: str, step: Callable[[], Any]) -> bool:
        """Run `step` (which needs the store) until it passes; False when stopped meanwhile."""
        def waiting(exc: BaseException, delay: float) -> None:
            self.health.reclaim_if_full(exc)
            self.say(f"{what}: the state store cannot be used ({exc})", delay)

        return until_stored(step, self.stop, waiting)


def until_stored(step: Callable[[], Any], stop: threading.Event,
                 on_wait: Callable[[BaseException, float], None]) -> bool:
    """Run `step` until it passes; a storage error (`storage_error`) is waited out with Backoff, `on_wait(error,
    delay)` told before each wait, anything else raised. False when `stop` was set meanwhile."""
    backoff = Backoff()
    while True:
        try:
            step()
            return True
        except (sqlite3.Error, OSError) as exc:
            if not storage_error(exc):
                raise
            delay = backoff.next()
            on_wait(exc, delay)
        if stop.wait(delay):
            return False


def storage_error(exc: BaseException) -> bool:
    """A failure of the disk or of the database's lock, not of the data: locked, busy, full, I/O, read-only."""
    if isinstance(exc, sqlite3.OperationalError):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


class Backoff:
    """Delays of `low`, twice that, ... up to `high` seconds; `reset` starts again at `low`."""

    def __init__(self, low: float = RETRY_MIN_S, high: float = RETRY_MAX_S) -> None:
        self.low, self.high = low, high
        self._next = low

    def next(self) -> float:
        """The delay to wait now; the one after is twice as long (at most `high`)."""
        delay, self._next = self._next, min(self.high, self._next * 2)
        return delay

    def reset(self) -> None:
        self._next = self.low


@dataclass
class _Write:
    """One write waiting for the store: what it is (for the log and status), how to make it, an event or not."""

    what: str
    write: Callable[[], Any]
    event: bool


class StorageHealth:
    """Counts failed state-store writes; `degraded` while the last one failed or writes wait. `on_full` (the
    agent's agent.storage.reclaim) runs when a write failed for a full disk, at most every RECLAIM_INTERVAL_S;
    `free_bytes` reads the space left on the disk of `where` (the state directory), for `storage_full`."""

    def __init__(self, emit: EventSink, on_full: Callable[[], Any] | None = None,
                 free_bytes: Callable[[], int] | None = None, where: str = "the state store") -> None:
        self._emit = emit
        self.where = where  # the directory the log names when the disk is full
        self.on_full = on_full
        self._free_bytes = free_bytes
        self._last_reclaim = float("-inf")
        self._lock = threading.Lock()
        self.failures = 0
        self.degraded_since: float | None = None  # time.time() of the first failure of this outage
        self.last_error: str | None = None
        self.last_write: str | None = None
        self.full: dict[str, Any] | None = None  # {"since", "free_bytes"} while the outage is a full disk
        self.unrecorded_events = 0  # events dropped from the waiting writes (too many waited)
        self._waiting: collections.deque[_Write] = collections.deque()
        self._flush_lock = threading.Lock()  # one flush at a time: a write is never made twice
        self._backoff = Backoff()
        self._retry_at: float | None = None
        self._retry_thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._outbox: Callable[[], dict[str, int]] | None = None

    def report_outbox(self, unstored: Callable[[], dict[str, int]]) -> None:
        """`unstored()` (agent.mqtt.publisher.Publisher.unstored: what the MQTT outbox could not take) joins
        `status()` as `outbox` while it counts anything."""
        self._outbox = unstored

    @property
    def degraded(self) -> bool:
        """True while the most recent guarded write failed, or writes wait for the store."""
        return self.degraded_since is not None

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run one write; a storage error is recorded (not raised), anything else passes through."""
        try:
            yield
        except STORAGE_ERRORS as exc:
            self._failed(what, exc)
        else:
            self._succeeded(what)

    def attempt(self, what: str, step: Callable[[], Any]) -> bool:
        """Run `step` once; a storage error (`storage_error`) is recorded like a failed write and gives False."""
        try:
            step()
        except STORAGE_ERRORS as exc:
            if not storage_error(exc):
                raise
            self._failed(what, exc)
            return False
        return True

    # --- writes that wait for the store --------------------------------------------------------

    def defer(self, what: str, write: Callable[[], Any], *, event: bool = False) -> bool:
        """Make `write` now, or keep it for later: behind writes already waiting, or when it fails for a storage
        error (then retried in the background until it lands). True when it was written now."""
        item = _Write(what, write, event)
        with self._lock:
            if self._waiting:
                self._keep(item)
                return False
        try:
            write()
        except STORAGE_ERRORS as exc:
            with self._lock:
                self._keep(item)
            self._failed(what, exc)
            self._start_retrying()
            return False
        if not event:  # a small event row can land on a disk that refused a bigger write: that ends no outage
            self._succeeded(what)
        return True

    def _keep(self, item: _Write) -> None:
        """Queue `item` (lock held); past MAX_WAITING_EVENTS waiting events, the oldest event goes."""
        self._waiting.append(item)
        if item.event and sum(w.event for w in self._waiting) > MAX_WAITING_EVENTS:
            oldest = next(w for w in self._waiting if w.event)
            self._waiting.remove(oldest)
            self.unrecorded_events += 1
            if self.unrecorded_events == 1 or self.unrecorded_events % 100 == 0:
                log.warning("state store: %d event(s) not recorded (more than %d waited for the store)",
                            self.unrecorded_events, MAX_WAITING_EVENTS)

    def _start_retrying(self) -> None:
        with self._lock:
            if self._closed.is_set() or self._retry_thread is not None:
                return
            self._retry_thread = threading.Thread(target=self._retry_loop, name="storage-retry", daemon=True)
            self._retry_thread.start()

    def _retry_loop(self) -> None:
        """Until nothing waits (decided under the lock, so a write kept meanwhile is never left behind)."""
        while not self._closed.is_set():
            delay = self._backoff.next()
            self._retry_at = time.time() + delay
            log.info("state store: %s waiting; next try in %.0f s", self._waiting_text(), delay)
            self._wake.wait(delay)
            self._wake.clear()
            if self._closed.is_set() or not self.flush():
                continue
            with self._lock:
                if not self._waiting:
                    self._retry_thread, self._retry_at = None, None
                    return

    def flush(self) -> bool:
        """Try the waiting writes in order until one fails; True when none is left."""
        with self._flush_lock:
            while True:
                with self._lock:
                    if not self._waiting:
                        break
                    item = self._waiting[0]
                try:
                    item.write()
                except STORAGE_ERRORS as exc:
                    self._failed(item.what, exc)
                    return False
                with self._lock:
                    if self._waiting and self._waiting[0] is item:
                        self._waiting.popleft()
        self._backoff.reset()
        self._succeeded("waiting writes")
        return True

    def close(self, flush: bool = True) -> None:
        """Stop retrying; with `flush`, one last try of what waits, and the log names what stays unrecorded."""
        self._closed.set()
        self._wake.set()
        thread = self._retry_thread
        if thread is not None:
            thread.join(STOP_JOIN_S)
        if flush and self._waiting and not self.flush():
            log.error("state store: %s not recorded before the agent stopped", self._waiting_text())

    def _waiting_text(self) -> str:
        with self._lock:
            records = [w.what for w in self._waiting if not w.event]
            events = sum(w.event for w in self._waiting)
        parts = records + ([f"{events} event(s)"] if events else [])
        return ", ".join(parts) or "nothing"

    # --- outages -------------------------------------------------------------------------------

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            self.last_error, self.last_write = type(exc).__name__, what  # the text stays in the log: it may hold paths
            first = self.degraded_since is None
            if first:
                self.degraded_since = time.time()
        if first:
            log.error("state store write failed (%s): %s; inference goes on and the store is tried again", what, exc)
            self._emit("storage_degraded", code="STORAGE_DEGRADED", write=what, error=type(exc).__name__,
                       **({"disk_full": True} if disk_full(exc) else {}))
        else:
            log.debug("state store write failed again (%s): %s", what, exc)
        self.reclaim_if_full(exc)
        if disk_full(exc):
            with self._lock:
                first_full, self.full = self.full is None, self.full or {"since": time.time(), "free_bytes": None}
            if first_full:
                self._report_full()

    def _report_full(self) -> None:
        """STORAGE_FULL, once per outage: the disk stays full after shedding what it could."""
        free = self._free_bytes() if self._free_bytes is not None else None
        self.full = {**(self.full or {"since": time.time()}), "free_bytes": free}
        log.error("STORAGE_FULL: the disk holding %s is full (%s bytes free after shedding what it could); the agent "
                  "serves on, and its records wait until there is room: free space there, or set state_dir on another "
                  "disk", self.where, "?" if free is None else free)
        self._emit("storage_full", code="STORAGE_FULL", free_bytes=free)

    def reclaim_if_full(self, exc: BaseException) -> bool:
        """Run `on_full` when `exc` says the disk is full (rate-limited); True when it ran."""
        if self.on_full is None or not disk_full(exc) or time.monotonic() - self._last_reclaim < RECLAIM_INTERVAL_S:
            return False
        self._last_reclaim = time.monotonic()
        try:
            self.on_full()
        except Exception:  # reclaiming is best effort; the agent goes on
            log.exception("reclaiming disk space failed")
        return True

    def _succeeded(self, what: str) -> None:
        with self._lock:
            if self._waiting:  # the store takes writes again: the waiting ones go first, then the outage ends
                self._wake.set()
                return
            since, self.degraded_since = self.degraded_since, None
            self.full = None
            failures = self.failures
        if since is not None:
            log.warning("state store writes again (%s) after %.1f s, %d failed write(s)", what, time.time() - since,
                        failures)
            self._emit("storage_recovered", write=what, degraded_s=round(time.time() - since, 1), failures=failures)

    def status(self) -> dict[str, Any]:
        """`{"degraded", "failures", "since", "last_error", "last_write", "waiting", "retry_in_s", "full",
        "unrecorded_events", "outbox"?}` for status and telemetry."""
        retry_at = self._retry_at
        with self._lock:
            waiting = len(self._waiting)
        out = {"degraded": self.degraded, "failures": self.failures, "since": self.degraded_since,
               "last_error": self.last_error, "last_write": self.last_write,
               "waiting": self._waiting_text() if waiting else None,
               "retry_in_s": round(max(0.0, retry_at - time.time()), 1) if retry_at is not None and waiting else None,
               "full": self.full, "unrecorded_events": self.unrecorded_events}
        outbox = self._outbox() if self._outbox is not None else None
        if outbox:
            out["outbox"] = outbox
        return out
