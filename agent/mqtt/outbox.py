"""SQLite store-and-forward outbox: telemetry and events survive outages and restarts, in order, bounded.

Every row is stamped at enqueue time with the device's persistent `seq` and this boot's `boot_id`, so a
collector can detect gaps and duplicates, and with the store's `epoch`: a random id made when the store is
created. A store that is recreated (a corrupt state.db moved aside, the counters lost) numbers from seq 1
again under the same kernel boot; its new epoch makes that a new stream at the collector instead of
duplicates it would drop. A store from before epochs keeps epoch 0, sent as no `epoch` at all, so its
stream continues unchanged. Over the caps, the oldest telemetry goes first, events last;
every drop is counted (persisted) and logged.

When the outbox itself cannot be written (state.db locked by another process, the disk full), events go to
`MemoryEvents` instead: a small in-memory queue the publisher sends from directly while the broker is up. They
cannot take the stored `seq` (nothing can advance it), so they are a stream of their own: `"volatile": true`,
this process's own `epoch`, `seq` from 1. A full queue drops its oldest event, counted.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import secrets
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from agent.storage.schema import ensure_outbox

log = logging.getLogger(__name__)

STAMP_KEYS = ("seq", "boot_id", "epoch")
TELEMETRY, EVENT = "telemetry", "event"
DROP_COUNTERS = ("dropped_telemetry", "dropped_event", "dropped_other")
BOOT_ID_PATH = "proc/sys/kernel/random/boot_id"
MEMORY_EVENTS = 256  # events held in memory while the outbox cannot be written
BUSY_TIMEOUT_MS = 5000  # how long a write waits for another connection's lock


def read_boot_id(root: Path = Path("/")) -> str:
    """This boot's id from the kernel; a random one (logged) where the kernel has none (not Linux)."""
    path = root / BOOT_ID_PATH
    try:
        return path.read_text(encoding="ascii").strip()
    except OSError as exc:
        fallback = str(uuid.uuid4())
        log.warning("no boot id at %s (%s); using %s for this process", path, exc.strerror, fallback)
        return fallback


def to_json_bytes(obj: dict[str, Any]) -> bytes:
    """Compact JSON; a NaN/inf reading is left out (absent, never a fake number), as the contract says."""
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=_json_default).encode()
    except ValueError:
        return json.dumps(_finite(obj), separators=(",", ":"), default=_json_default).encode()


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items() if not _non_finite(v)}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value if not _non_finite(v)]
    return value


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


@dataclass(frozen=True)
class OutboxRow:
    """One buffered message as stored."""

    id: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    created: float


class Outbox:
    """The bounded, ordered, persistent queue between producers (telemetry, events) and the publisher."""

    def __init__(
        self,
        db_path: Path | str,
        *,
        max_rows: int = 200_000,
        max_bytes: int = 64 * 1024 * 1024,
        boot_id: str | None = None,
        root: Path = Path("/"),
    ) -> None:
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self.boot_id = boot_id or read_boot_id(root)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        self._rows: int  # the table's row count, payload bytes and last seq: set by _reload, kept in step
        self._bytes: int
        self._seq: int
        with self._lock:
            ensure_outbox(self._conn)
            self._reload()
            self.epoch = self._epoch()

    def enqueue(self, kind: str, topic: str, fields: dict[str, Any], *, qos: int = 1, retain: bool = False,
                wait_s: float | None = None) -> int:
        """Stamp `fields` with seq/boot_id/ts, store it, enforce the caps; returns the seq. `wait_s`: how long to
        wait for another process's write lock this time (default: the connection's 5 s)."""
        return self.enqueue_many(kind, topic, [fields], qos=qos, retain=retain, wait_s=wait_s)[0]

    def enqueue_many(
        self, kind: str, topic: str, items: Iterable[dict[str, Any]], *, qos: int = 1, retain: bool = False,
        wait_s: float | None = None,
    ) -> list[int]:
        """Like enqueue for many payloads in one transaction (backfills, benchmarks)."""
        now = time.time()
        with self._lock, self._busy_timeout(wait_s):
            seqs: list[int] = []
            rows: list[tuple[str, bytes, int, int, str, float]] = []
            size = 0
            for fields in items:
                seqs.append(self._seq + len(seqs) + 1)
                payload = to_json_bytes(self._stamp(fields, seqs[-1], now))
                rows.append((topic, payload, qos, int(retain), kind, now))
                size += len(payload)
            try:
                with self._transaction():
                    self._conn.executemany(
                        "INSERT INTO mqtt_outbox (topic, payload, qos, retain, kind, created) VALUES (?,?,?,?,?,?)",
                        rows,
                    )
                    self._set_counter("seq", self._seq + len(seqs))
                    last_id = self._conn.execute("SELECT last_insert_rowid()").fetchone()[0]
                    self._seq, self._rows, self._bytes = (
                        self._seq + len(seqs),
                        self._rows + len(rows),
                        self._bytes + size,
                    )
                    if self._rows > self.max_rows or self._bytes > self.max_bytes:
                        self._evict()
                self.last_id = last_id  # lets the publisher skip a query when nothing new arrived
            except sqlite3.Error:
                self._reload()  # the transaction rolled back: in-memory totals must follow the disk
                raise
            return seqs

    @contextlib.contextmanager
    def _busy_timeout(self, wait_s: float | None) -> Iterator[None]:
        """The connection's busy timeout set to `wait_s` inside (lock held), BUSY_TIMEOUT_MS again after."""
        if wait_s is None:
            yield
            return
        self._conn.execute(f"PRAGMA busy_timeout={int(wait_s * 1000)}")
        try:
            yield
        finally:
            self._conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")

    def _reload(self) -> None:
        self._rows, self._bytes = self._conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM mqtt_outbox"
        ).fetchone()
        self._seq = self._counter("seq")
        self.last_id = self._conn.execute("SELECT COALESCE(MAX(id), 0) FROM mqtt_outbox").fetchone()[0]
        self._dropped = {name: self._counter(name) for name in DROP_COUNTERS}

    def _epoch(self) -> int:
        """This store's epoch: made (random, non-zero) when the store has never numbered a message; 0 for a
        store that did before epochs existed (its stream goes on as it was)."""
        rows = self._conn.execute("SELECT value FROM mqtt_counters WHERE name = 'epoch'").fetchall()
        if rows:
            return int(rows[0][0])
        epoch = 0 if self._seq > 0 else new_epoch()
        try:
            self._conn.execute("INSERT OR IGNORE INTO mqtt_counters (name, value) VALUES ('epoch', ?)", (epoch,))
        except sqlite3.OperationalError as exc:  # locked or a full disk: this process stamps it, the next makes its own
            log.warning("outbox: epoch %d not stored (%s); rows stamped in this process carry it", epoch, exc)
            return epoch
        return int(self._conn.execute("SELECT value FROM mqtt_counters WHERE name = 'epoch'").fetchone()[0])

    def _stamp(self, fields: dict[str, Any], seq: int, now: float) -> dict[str, Any]:
        return stamp(fields, seq, self.boot_id, self.epoch, now)

    def _evict(self) -> None:
        """Drop oldest telemetry, then other kinds, then events, until under both caps (lock held)."""
        for kinds, counter in (([TELEMETRY], "dropped_telemetry"), (None, "dropped_other"), ([EVENT], "dropped_event")):
            dropped = 0
            while self._rows > self.max_rows or self._bytes > self.max_bytes:
                victims = self._oldest(kinds, max(self._rows - self.max_rows, 64))
                if not victims:
                    break
                dropped += self._drop_until_under(victims)
            if dropped:
                total = self._add_dropped(counter, dropped)
                log.warning("outbox full (%d rows, %d bytes): dropped %d oldest %s (total %d)",
                            self._rows, self._bytes, dropped, counter.removeprefix("dropped_"), total)
            if self._rows <= self.max_rows and self._bytes <= self.max_bytes:
                return

    def shed_telemetry(self, fraction: float = 0.5) -> tuple[int, int]:
        """Drop the oldest `fraction` of the waiting telemetry (a full disk: agent.storage.reclaim), counted
        as dropped_telemetry like any eviction; events stay. Returns (rows, payload bytes) dropped."""
        with self._lock:
            waiting = self._conn.execute("SELECT COUNT(*) FROM mqtt_outbox WHERE kind = ?", (TELEMETRY,)).fetchone()[0]
            victims = self._oldest([TELEMETRY], int(waiting * fraction))
            if not victims:
                return 0, 0
            size = sum(s for _, s in victims)
            try:
                with self._transaction():
                    self._delete_ids([row_id for row_id, _ in victims])
                    self._rows, self._bytes = self._rows - len(victims), self._bytes - size
                    self._add_dropped("dropped_telemetry", len(victims))
            except sqlite3.Error:
                self._reload()  # rolled back: the in-memory totals follow the disk
                raise
        log.warning("outbox: dropped the oldest %d telemetry rows (%d bytes) to free disk space", len(victims), size)
        return len(victims), size

    def _add_dropped(self, counter: str, count: int) -> int:
        """Count `count` more drops in `counter`, in memory and in the store (transaction held); the new total."""
        total = self._dropped[counter] = self._dropped[counter] + count
        self._set_counter(counter, total)
        return total

    def _oldest(self, kinds: list[str] | None, limit: int) -> list[tuple[int, int]]:
        if kinds is None:
            sql = "SELECT id, LENGTH(payload) FROM mqtt_outbox WHERE kind NOT IN (?, ?) ORDER BY id LIMIT ?"
            return self._conn.execute(sql, (TELEMETRY, EVENT, limit)).fetchall()
        sql = "SELECT id, LENGTH(payload) FROM mqtt_outbox WHERE kind = ? ORDER BY id LIMIT ?"
        return self._conn.execute(sql, (kinds[0], limit)).fetchall()

    def _drop_until_under(self, victims: list[tuple[int, int]]) -> int:
        ids: list[int] = []
        for row_id, size in victims:
            if self._rows - len(ids) <= self.max_rows and self._bytes <= self.max_bytes:
                break
            ids.append(row_id)
            self._bytes -= size
        self._delete_ids(ids)
        self._rows -= len(ids)
        return len(ids)

    def fetch(self, after_id: int, upto_id: int | None = None, limit: int = 500) -> list[OutboxRow]:
        """Rows with after_id < id <= upto_id, oldest first."""
        upto = upto_id if upto_id is not None else 2**63 - 1
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, topic, payload, qos, retain, created FROM mqtt_outbox "
                "WHERE id > ? AND id <= ? ORDER BY id LIMIT ?",
                (after_id, upto, limit),
            ).fetchall()
        return [OutboxRow(r[0], r[1], bytes(r[2]), r[3], bool(r[4]), r[5]) for r in rows]

    def max_id(self) -> int:
        """Highest row id present (0 when empty): the boundary between backlog and live rows."""
        with self._lock:
            return self._conn.execute("SELECT COALESCE(MAX(id), 0) FROM mqtt_outbox").fetchone()[0]

    def delete(self, ids: Sequence[int]) -> int:
        """Remove acknowledged rows; returns how many existed."""
        if not ids:
            return 0
        count, size = 0, 0
        with self._lock:
            with self._transaction():
                for chunk in _chunks(list(ids), 500):
                    marks = ",".join("?" * len(chunk))
                    c, s = self._conn.execute(
                        f"SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM mqtt_outbox WHERE id IN ({marks})",
                        chunk,
                    ).fetchone()
                    self._conn.execute(f"DELETE FROM mqtt_outbox WHERE id IN ({marks})", chunk)
                    count, size = count + c, size + s
            self._rows -= count  # only once committed
            self._bytes -= size
        return count

    def _delete_ids(self, ids: list[int]) -> None:
        for chunk in _chunks(ids, 500):
            self._conn.execute(f"DELETE FROM mqtt_outbox WHERE id IN ({','.join('?' * len(chunk))})", chunk)

    def stats(self) -> dict[str, int]:
        """Rows and bytes buffered, last seq, and the persisted drop counters."""
        with self._lock:
            return {"rows": self._rows, "bytes": self._bytes, "seq": self._seq, **self._dropped}

    def __len__(self) -> int:
        return self._rows

    def close(self) -> None:
        """Close the connection; the data stays on disk."""
        with self._lock:
            self._conn.close()

    def _counter(self, name: str) -> int:
        row = self._conn.execute("SELECT value FROM mqtt_counters WHERE name = ?", (name,)).fetchone()
        return row[0] if row else 0

    def _set_counter(self, name: str, value: int) -> None:
        self._conn.execute(
            "INSERT INTO mqtt_counters (name, value) VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET value = excluded.value", (name, value)
        )

    def _transaction(self) -> "_Transaction":
        return _Transaction(self._conn)


class MemoryEvents:
    """Events the outbox could not store, waiting in memory for a direct publish (module docstring): at most
    `capacity`, the oldest dropped first and counted (`dropped`); `held` counts every event ever put here."""

    def __init__(self, boot_id: str, capacity: int = MEMORY_EVENTS, avoid_epoch: int = 0) -> None:
        self.boot_id, self.capacity = boot_id, capacity
        self.epoch = new_epoch()
        while self.epoch == avoid_epoch:
            self.epoch = new_epoch()
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[str, bytes]] = collections.deque()
        self._seq = 0
        self.held = self.dropped = 0

    def put(self, topic: str, fields: dict[str, Any]) -> int:
        """Stamp `fields` (this stream's seq, boot_id, epoch, ts, `volatile`) and keep it; returns its seq."""
        with self._lock:
            self._seq += 1
            self.held += 1
            body = stamp(fields, self._seq, self.boot_id, self.epoch, time.time())
            self._queue.append((topic, to_json_bytes({**body, "volatile": True})))
            self._drop_over_capacity()
            return self._seq

    def take(self) -> tuple[str, bytes] | None:
        """The oldest waiting (topic, payload), removed; None when empty."""
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def put_back(self, items: list[tuple[str, bytes]]) -> None:
        """Return unsent or unacknowledged messages to the front, in their order (a lost connection)."""
        with self._lock:
            self._queue.extendleft(reversed(items))
            self._drop_over_capacity()

    def _drop_over_capacity(self) -> None:
        dropped = 0
        while len(self._queue) > self.capacity:
            self._queue.popleft()
            dropped += 1
        if dropped:
            self.dropped += dropped
            log.warning("events held in memory (the outbox cannot be written) over %d: dropped the oldest %d "
                        "(total %d)", self.capacity, dropped, self.dropped)

    def __len__(self) -> int:
        return len(self._queue)


def new_epoch() -> int:
    """A random positive stream id (31 bits)."""
    return 1 + secrets.randbelow(2**31 - 1)


def stamp(fields: dict[str, Any], seq: int, boot_id: str, epoch: int, now: float) -> dict[str, Any]:
    """`fields` with seq, boot_id, ts (kept when given) and epoch (left out when 0) first."""
    clash = [key for key in STAMP_KEYS if key in fields]
    if clash:
        raise ValueError(f"fields {clash} are stamped by the outbox; do not pass them")
    stamped: dict[str, Any] = {"seq": seq, "boot_id": boot_id, "ts": fields.get("ts", now)}
    if epoch:
        stamped["epoch"] = epoch
    stamped.update(fields)
    return stamped


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on error (the connection is in autocommit mode)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._conn.execute("ROLLBACK" if exc_type else "COMMIT")


def _chunks(items: list[int], size: int) -> Iterable[list[int]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
