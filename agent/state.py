"""The agent's state store: one SQLite file in WAL mode with versioned migrations.

Migrations are append-only: each entry runs once, in order, inside a transaction, and
`PRAGMA user_version` records how far a database has come. A newer database than this code knows
is refused rather than guessed at.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

import sqlite_utils

from engines.errors import EdgeError

Migration = Callable[[sqlite_utils.Database], None]


def _m001_core(db: sqlite_utils.Database) -> None:
    db.execute(
        """CREATE TABLE runs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            started_at REAL NOT NULL,
            ended_at REAL,
            pid INTEGER,
            status TEXT NOT NULL DEFAULT 'running',
            model TEXT,
            summary TEXT)"""
    )
    db.execute(
        """CREATE TABLE active_model (
            slot TEXT PRIMARY KEY CHECK (slot IN ('active', 'previous')),
            name TEXT NOT NULL, version TEXT NOT NULL, path TEXT NOT NULL,
            sha256 TEXT NOT NULL, info TEXT, since REAL NOT NULL)"""
    )
    db.execute(
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            ts REAL NOT NULL, type TEXT NOT NULL, payload TEXT NOT NULL)"""
    )
    db.execute("CREATE INDEX events_ts ON events(ts)")
    db.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


def _m002_deployments(db: sqlite_utils.Database) -> None:
    from agent.deployments.store import migrate_deployments  # the table belongs to that module

    migrate_deployments(db)


def _m003_planes(db: sqlite_utils.Database) -> None:
    """MQTT outbox and counters, command replies, engine cache index (each module owns its DDL)."""
    from agent.commands import ensure_schema as replies
    from agent.mqtt import ensure_schema as outbox
    from engines.cache import ensure_schema as engines

    for ensure in (outbox, replies, engines):
        ensure(db.conn)


def _m004_model_versions(db: sqlite_utils.Database) -> None:
    """Highest deployed version per model name (the downgrade rule; agent.deployments.versions owns it)."""
    from agent.deployments.versions import ensure_schema

    ensure_schema(db.conn)


MIGRATIONS: list[Migration] = [_m001_core, _m002_deployments, _m003_planes, _m004_model_versions]


class StateStoreError(EdgeError):
    """The state database cannot be opened or is from a newer agent."""

    code = "STATE_STORE"


class StateStore:
    """Thread-safe access to the state database; every write is its own transaction."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=10, isolation_level=None)
            self.db = sqlite_utils.Database(conn)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
        except sqlite3.DatabaseError as exc:
            raise StateStoreError(f"{self.path}: cannot open state database: {exc}") from exc
        self._lock = threading.RLock()
        self._depth = 0
        self.migrate()

    @property
    def schema_version(self) -> int:
        """How many migrations this database has."""
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    def migrate(self, migrations: list[Migration] | None = None) -> None:
        """Apply the migrations this database has not had yet."""
        migrations = MIGRATIONS if migrations is None else migrations
        with self._lock:
            current = self.schema_version
            if current > len(migrations):
                raise StateStoreError(
                    f"{self.path}: schema version {current} is newer than this agent knows ({len(migrations)}); "
                    "upgrade the agent or move the state directory aside"
                )
            for number in range(current, len(migrations)):
                with self.transaction():
                    migrations[number](self.db)
                    self.db.execute(f"PRAGMA user_version = {number + 1}")

    def transaction(self) -> "_Transaction":
        """`with store.transaction():` — BEGIN IMMEDIATE … COMMIT, rolled back on error."""
        return _Transaction(self)

    def execute(self, sql: str, params: tuple | dict = ()) -> sqlite3.Cursor:
        """One statement under the store's lock."""
        with self._lock:
            return self.db.execute(sql, params)

    def query(self, sql: str, params: tuple | dict = ()) -> list[dict[str, Any]]:
        """Rows as dicts."""
        with self._lock:
            return list(self.db.query(sql, params))

    # --- runs -------------------------------------------------------------------------------

    def start_run(self, pid: int) -> int:
        """Record a run; an earlier run still marked running ended without a clean stop."""
        with self.transaction():
            self.db.execute("UPDATE runs SET status = 'crashed' WHERE status = 'running'")
            cur = self.db.execute("INSERT INTO runs (started_at, pid) VALUES (?, ?)", (time.time(), pid))
            return int(cur.lastrowid)

    def finish_run(self, run_id: int, summary: dict[str, Any], status: str = "stopped") -> None:
        """Store the run summary."""
        model = summary.get("model", {})
        label = f"{model.get('name')}@{model.get('version')}" if model else None
        self.execute(
            "UPDATE runs SET ended_at = ?, status = ?, model = ?, summary = ? WHERE id = ?",
            (time.time(), status, label, json.dumps(summary), run_id),
        )

    def last_run(self) -> dict[str, Any] | None:
        """The newest run with its decoded summary."""
        rows = self.query("SELECT * FROM runs ORDER BY id DESC LIMIT 1")
        if not rows:
            return None
        row = rows[0]
        row["summary"] = json.loads(row["summary"]) if row["summary"] else None
        return row

    # --- active model -----------------------------------------------------------------------

    def set_active_model(self, name: str, version: str, path: str, sha256: str, info: dict[str, Any]) -> None:
        """Make a model active; the old active one becomes `previous` (for rollback)."""
        with self.transaction():
            old = list(self.db.query("SELECT * FROM active_model WHERE slot = 'active'"))
            if old and (old[0]["sha256"], old[0]["path"]) != (sha256, path):
                self.db.execute("DELETE FROM active_model WHERE slot = 'previous'")
                self.db.execute("UPDATE active_model SET slot = 'previous' WHERE slot = 'active'")
            self.db.execute(
                "INSERT OR REPLACE INTO active_model (slot, name, version, path, sha256, info, since) "
                "VALUES ('active', ?, ?, ?, ?, ?, ?)",
                (name, version, path, sha256, json.dumps(info), time.time()),
            )

    def model_slot(self, slot: str = "active") -> dict[str, Any] | None:
        """The active or previous model row."""
        rows = self.query("SELECT * FROM active_model WHERE slot = ?", (slot,))
        if not rows:
            return None
        rows[0]["info"] = json.loads(rows[0]["info"] or "{}")
        return rows[0]

    # --- events and key/value ---------------------------------------------------------------

    def add_event(self, type_: str, payload: dict[str, Any], keep: int = 10_000) -> None:
        """Append an event; the table keeps only the newest `keep` rows."""
        with self.transaction():
            cur = self.db.execute(
                "INSERT INTO events (ts, type, payload) VALUES (?, ?, ?)", (time.time(), type_, json.dumps(payload))
            )
            if cur.lastrowid and cur.lastrowid % 1000 == 0:
                self.db.execute("DELETE FROM events WHERE id <= ?", (cur.lastrowid - keep,))

    def events(self, limit: int = 50) -> list[dict[str, Any]]:
        """Newest events first."""
        rows = self.query("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,))
        for row in rows:
            row["payload"] = json.loads(row["payload"])
        return rows

    def get_kv(self, key: str, default: Any = None) -> Any:
        """A small persisted setting (JSON value)."""
        rows = self.query("SELECT value FROM kv WHERE key = ?", (key,))
        return json.loads(rows[0]["value"]) if rows else default

    def set_kv(self, key: str, value: Any) -> None:
        """Persist a small setting."""
        self.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def close(self) -> None:
        """Checkpoint the WAL and close."""
        with self._lock:
            try:
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                self.db.conn.close()


class _Transaction:
    """Re-entrant: an inner `with store.transaction()` joins the outer one (one COMMIT at the end)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def __enter__(self) -> sqlite_utils.Database:
        self.store._lock.acquire()
        self.store._depth += 1
        if self.store._depth == 1:
            self.store.db.execute("BEGIN IMMEDIATE")
        return self.store.db

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if self.store._depth == 1:
                self.store.db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.store._depth -= 1
            self.store._lock.release()


def state_db_path(state_dir: Path) -> Path:
    """Where the state database lives inside the state directory."""
    return Path(state_dir) / "state.db"


