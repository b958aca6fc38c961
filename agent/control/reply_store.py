"""The replies of executed commands by id (agent.control.commands), so a repeated id gets its first reply, not a
second run.

`RememberedReplies` answers from memory and writes behind: a reply is in memory (and can be sent) the moment it
exists, and a `reply-store` thread copies it to the state database, retrying while another process holds the
database locked. So a reply never waits on the disk, a repeated id is answered from memory even while the disk
copy is pending or failed, and the disk copy is what survives a restart (read back into memory at start).
A bounded window, by count and by age, in both; the table is declared in agent.storage.schema (`ensure_replies`).
"""

from __future__ import annotations

import collections
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from agent.storage.schema import ensure_replies

log = logging.getLogger(__name__)

Row = tuple[str, str, dict[str, Any], float]  # id, command, reply, ts


class ReplyStore:
    """Replies of executed commands by id, for a bounded window (count and age), in SQLite."""

    def __init__(self, db_path: Path | str, *, max_entries: int = 1000, max_age_s: float = 86400.0,
                 busy_timeout_s: float = 5.0, probe_wait_s: float = 0.05) -> None:
        self.max_entries, self.max_age_s = max_entries, max_age_s
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        ensure_replies(self._conn)
        # its own connection, so a probe never queues behind a write waiting out the busy timeout
        self._probe_lock = threading.Lock()
        self._probe = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None,
                                      timeout=probe_wait_s)

    def get(self, command_id: str) -> dict[str, Any] | None:
        """The remembered reply, or None (never seen, or older than the window)."""
        with self._lock:
            row = self._conn.execute("SELECT reply, ts FROM command_replies WHERE id = ?", (command_id,)).fetchone()
        if row is None or time.time() - row[1] > self.max_age_s:
            return None
        return json.loads(row[0])

    def window(self) -> list[Row]:
        """The replies inside the window, oldest first."""
        with self._lock:
            rows = self._conn.execute("SELECT id, command, reply, ts FROM command_replies WHERE ts >= ? "
                                      "ORDER BY ts DESC, rowid DESC LIMIT ?",
                                      (time.time() - self.max_age_s, self.max_entries)).fetchall()
        return [(rid, command, json.loads(reply), ts) for rid, command, reply, ts in reversed(rows)]

    def put(self, command_id: str, command_name: str, reply: dict[str, Any]) -> None:
        """Remember a reply and prune what falls out of the window."""
        self.put_many([(command_id, command_name, reply, time.time())])

    def put_many(self, rows: list[Row]) -> None:
        """Remember replies in one transaction and prune what falls out of the window."""
        now = time.time()
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany("INSERT OR REPLACE INTO command_replies (id, command, reply, ts) "
                                       "VALUES (?,?,?,?)",
                                       [(rid, command, json.dumps(reply), ts) for rid, command, reply, ts in rows])
                self._conn.execute("DELETE FROM command_replies WHERE ts < ?", (now - self.max_age_s,))
                self._conn.execute(
                    "DELETE FROM command_replies WHERE id NOT IN "
                    "(SELECT id FROM command_replies ORDER BY ts DESC, rowid DESC LIMIT ?)", (self.max_entries,))
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def write_locked(self) -> bool:
        """True when another connection holds the database's write lock longer than the probe waits (50 ms)."""
        with self._probe_lock:
            try:
                self._probe.execute("BEGIN IMMEDIATE")
                self._probe.execute("ROLLBACK")
                return False
            except sqlite3.OperationalError as exc:
                return "locked" in str(exc) or "busy" in str(exc)

    def close(self) -> None:
        """Close the database connections."""
        with self._lock, self._probe_lock:
            self._conn.close()
            self._probe.close()


class RememberedReplies:
    """The reply window in memory, written behind to a ReplyStore by the `reply-store` thread.

    Counters (`stats`): `remembered` replies written to disk, `not_remembered` replies whose first write failed
    (they stay pending and are retried every `retry_s`), `lost` replies dropped before they were ever written
    (more pending than the window holds, or still pending at close), `pending` now, `write_failures` attempts.
    """

    def __init__(self, store: ReplyStore, *, retry_s: float = 1.0, close_wait_s: float = 10.0) -> None:
        self.store, self.retry_s, self.close_wait_s = store, retry_s, close_wait_s
        self._memory: collections.OrderedDict[str, tuple[dict[str, Any], float]] = collections.OrderedDict()
        self._pending: collections.OrderedDict[str, Row] = collections.OrderedDict()
        self._failed_once: set[str] = set()
        self._cond = threading.Condition()
        self._stop = False
        self._outage_since: float | None = None
        self.counters: collections.Counter[str] = collections.Counter()
        self.loaded = self._load()
        self._writer: threading.Thread | None = None  # runs only while replies are pending

    def get(self, command_id: str) -> dict[str, Any] | None:
        """The reply of `command_id` inside the window, or None. Raises sqlite3.Error only when the window could
        not be read from disk at start and still cannot (a repeated id from before this start might be missed)."""
        if not self.loaded:
            self.loaded = self._load(raise_errors=True)
        with self._cond:
            entry = self._memory.get(command_id)
            if entry is None:
                return None
            if time.time() - entry[1] > self.store.max_age_s:
                del self._memory[command_id]
                return None
            return entry[0]

    def remember(self, command_id: str, command_name: str, reply: dict[str, Any]) -> None:
        """Keep `reply` for `command_id` now; the disk copy follows on the writer thread."""
        now = time.time()
        with self._cond:
            self._memory[command_id] = (reply, now)
            self._memory.move_to_end(command_id)
            while len(self._memory) > self.store.max_entries:
                self._memory.popitem(last=False)
            self._pending[command_id] = (command_id, command_name, reply, now)
            self._pending.move_to_end(command_id)
            while len(self._pending) > self.store.max_entries:
                dropped, _ = self._pending.popitem(last=False)
                self._failed_once.discard(dropped)
                self.counters["lost"] += 1
            if self._writer is None and not self._stop:
                self._writer = threading.Thread(target=self._write_behind, name="reply-store", daemon=True)
                self._writer.start()

    def stats(self) -> dict[str, int]:
        """remembered, not_remembered, lost, pending, write_failures."""
        with self._cond:
            return {"remembered": self.counters["remembered"], "not_remembered": self.counters["not_remembered"],
                    "lost": self.counters["lost"], "pending": len(self._pending),
                    "write_failures": self.counters["write_failures"]}

    def close(self) -> None:
        """Write what is pending (one last try, bounded by the store's busy timeout), then close the store."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(self.close_wait_s)
        if writer is not None and writer.is_alive():
            log.error("reply store writer did not finish within %.0f s; %d replies not remembered",
                      self.close_wait_s, len(self._pending))
            return  # the connection is still in use: closing it under the writer would be worse than leaving it
        with self._cond:
            if self._pending:
                self.counters["lost"] += len(self._pending)
                log.warning("%d command replies not remembered at close: a retry of their ids runs them again",
                            len(self._pending))
                self._pending.clear()
        self.store.close()

    def _load(self, raise_errors: bool = False) -> bool:
        try:
            rows = self.store.window()
        except sqlite3.Error as exc:
            if raise_errors:
                raise
            log.warning("remembered command replies not read (%s): ids from before this start are checked "
                        "against the disk when they come", exc)
            return False
        with self._cond:
            for rid, _command, reply, ts in rows:
                self._memory.setdefault(rid, (reply, ts))
        return True

    def _write_behind(self) -> None:
        """Write what is pending until nothing is (then the thread ends), retrying every retry_s; at close, one
        last try."""
        while True:
            with self._cond:
                if not self._pending:
                    self._writer = None
                    return
                rows, stopping = list(self._pending.values()), self._stop
            written = self._write(rows)
            with self._cond:
                if stopping:
                    self._writer = None
                    return
                if not written:
                    self._cond.wait_for(lambda: self._stop, self.retry_s)  # a stop ends the wait: one last try

    def _write(self, rows: list[Row]) -> bool:
        try:
            self.store.put_many(rows)
        except sqlite3.Error as exc:
            self._failed(rows, exc)
            return False
        with self._cond:
            for row in rows:
                if self._pending.get(row[0]) is row:  # not replaced by a newer reply meanwhile
                    del self._pending[row[0]]
                self._failed_once.discard(row[0])
            self.counters["remembered"] += len(rows)
            outage, self._outage_since = self._outage_since, None
        if outage is not None:
            log.info("command replies written to the state database again after %.1f s", time.time() - outage)
        return True

    def _failed(self, rows: list[Row], exc: sqlite3.Error) -> None:
        with self._cond:
            self.counters["write_failures"] += 1
            fresh = [row[0] for row in rows if row[0] not in self._failed_once]
            self._failed_once.update(fresh)
            self.counters["not_remembered"] += len(fresh)
            first = self._outage_since is None
            if first:
                self._outage_since = time.time()
        if first:
            log.warning("command replies not remembered on disk (%s): they were sent, repeated ids are answered "
                        "from memory, and the write is retried every %.0f s", exc, self.retry_s)
