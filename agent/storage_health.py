"""Writes to the state store that must never take the agent down, and the record of the ones that failed.

Another process holding `state.db`'s write lock past the busy timeout, an I/O error or a full disk makes a
write raise `sqlite3.OperationalError` (or OSError). Inference needs no disk, so such a write is isolated
(`StorageHealth.guard`): it is logged once per outage, counted, the agent's health turns `degraded`, a
`storage_degraded` event goes out (to MQTT even when it cannot be stored), and the next write that
succeeds ends the outage with `storage_recovered` and the numbers (issue 19).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sqlite3
import threading
import time
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

STORAGE_ERRORS = (sqlite3.Error, OSError)

EventSink = Callable[..., None]


RECLAIM_INTERVAL_S = 60.0  # a full disk is reclaimed from at most this often


def disk_full(exc: BaseException) -> bool:
    """SQLite's "database or disk is full" (SQLITE_FULL), or an OSError ENOSPC / EDQUOT."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "disk is full" in str(exc) or getattr(exc, "sqlite_errorname", "") == "SQLITE_FULL"


class StorageHealth:
    """Counts failed state-store writes; `degraded` while the last one failed. `on_full` (the agent's
    agent.storage_reclaim) runs when a write failed for a full disk, at most every RECLAIM_INTERVAL_S."""

    def __init__(self, emit: EventSink, on_full: Callable[[], Any] | None = None) -> None:
        self._emit = emit
        self.on_full = on_full
        self._last_reclaim = float("-inf")
        self._lock = threading.Lock()
        self.failures = 0
        self.degraded_since: float | None = None  # time.time() of the first failure of this outage
        self.last_error: str | None = None
        self.last_write: str | None = None

    @property
    def degraded(self) -> bool:
        """True while the most recent guarded write failed."""
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

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            self.last_error, self.last_write = type(exc).__name__, what  # the text stays in the log: it may hold paths
            first = self.degraded_since is None
            if first:
                self.degraded_since = time.time()
        if first:
            log.error("state store write failed (%s): %s; inference goes on, retried at the next write", what, exc)
            self._emit("storage_degraded", code="STORAGE_DEGRADED", write=what, error=type(exc).__name__,
                       **({"disk_full": True} if disk_full(exc) else {}))
        else:
            log.debug("state store write failed again (%s): %s", what, exc)
        self.reclaim_if_full(exc)

    def reclaim_if_full(self, exc: BaseException) -> bool:
        """Run `on_full` when `exc` says the disk is full (rate-limited); True when it ran."""
        if self.on_full is None or not disk_full(exc) or time.monotonic() - self._last_reclaim < RECLAIM_INTERVAL_S:
            return False
        self._last_reclaim = time.monotonic()
        try:
            self.on_full()
        except Exception:  # noqa: BLE001 - reclaiming is best effort; the agent goes on
            log.exception("reclaiming disk space failed")
        return True

    def _succeeded(self, what: str) -> None:
        with self._lock:
            since, self.degraded_since = self.degraded_since, None
            failures = self.failures
        if since is not None:
            log.warning("state store writes again (%s) after %.1f s, %d failed write(s)", what, time.time() - since,
                        failures)
            self._emit("storage_recovered", write=what, degraded_s=round(time.time() - since, 1), failures=failures)

    def status(self) -> dict[str, Any]:
        """`{"degraded", "failures", "since", "last_error", "last_write"}` for status and telemetry."""
        return {"degraded": self.degraded, "failures": self.failures, "since": self.degraded_since,
                "last_error": self.last_error, "last_write": self.last_write}
