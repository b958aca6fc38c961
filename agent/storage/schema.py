"""The agent's SQLite schema, all of it: every table of the state database and the migrations that create them.

One module, as deploy/fleet/schema.py is for the fleet. The state store (agent.storage.state) runs MIGRATIONS in
order (the `user_version` pragma says how far a file is). The stores that keep their own connection to the same file
-- the MQTT outbox, the command replies, the engine cache index -- create their tables with the idempotent `ensure_*`
functions here, so each table is declared once and no store imports another to migrate it.
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:  # the outbox and the fleet side import this module; sqlite_utils imports numpy when present
    import sqlite_utils

Migration = Callable[["sqlite_utils.Database"], None]

OUTBOX_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS mqtt_outbox (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        topic TEXT NOT NULL,
        payload BLOB NOT NULL,
        qos INTEGER NOT NULL DEFAULT 1,
        retain INTEGER NOT NULL DEFAULT 0,
        kind TEXT NOT NULL,
        created REAL NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS mqtt_outbox_kind_id ON mqtt_outbox (kind, id)",
    "CREATE TABLE IF NOT EXISTS mqtt_counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
)

REPLY_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS command_replies (id TEXT PRIMARY KEY, command TEXT NOT NULL, "
    "reply TEXT NOT NULL, ts REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS command_replies_ts ON command_replies (ts)",
)

VERSIONS_SCHEMA = ("CREATE TABLE IF NOT EXISTS model_versions (name TEXT PRIMARY KEY, version TEXT NOT NULL, "
                   "deployment_id TEXT, updated REAL NOT NULL)",)



def _run(conn: sqlite3.Connection, statements: Iterable[str]) -> None:
    for statement in statements:
        conn.execute(statement)


def ensure_outbox(conn: sqlite3.Connection) -> None:
    """The MQTT outbox and its counters (agent.mqtt.outbox), if missing."""
    _run(conn, OUTBOX_SCHEMA)


def ensure_replies(conn: sqlite3.Connection) -> None:
    """The remembered command replies (agent.control.reply_store.ReplyStore), if missing."""
    _run(conn, REPLY_SCHEMA)


def ensure_model_versions(conn: sqlite3.Connection) -> None:
    """The highest deployed version per model name (the downgrade rule, agent.deployments.versions), if missing."""
    _run(conn, VERSIONS_SCHEMA)


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
    """Deployments and their transition log (agent.deployments.store)."""
    db.execute(
        """CREATE TABLE deployments (
            id TEXT PRIMARY KEY, url TEXT NOT NULL, state TEXT NOT NULL,
            reason TEXT, message TEXT, created REAL NOT NULL, updated REAL NOT NULL,
            artifact_dir TEXT, model_name TEXT, model_version TEXT, sha256 TEXT, engine_key TEXT,
            details TEXT NOT NULL DEFAULT '{}')"""
    )
    db.execute("CREATE INDEX deployments_state ON deployments(state)")
    db.execute(
        """CREATE TABLE deployment_transitions (
            id INTEGER PRIMARY KEY AUTOINCREMENT, deployment_id TEXT NOT NULL,
            state TEXT NOT NULL, ts REAL NOT NULL, info TEXT NOT NULL DEFAULT '{}')"""
    )



def _m003_planes(db: sqlite_utils.Database) -> None:
    """MQTT outbox and counters, command replies, engine cache index."""
    # here, not at the top: the outbox and the fleet side import this module, and the cache imports numpy/OpenCV
    from engines.build.cache import ensure_schema as ensure_engine_index

    for ensure in (ensure_outbox, ensure_replies, ensure_engine_index):
        ensure(db.conn)


def _m004_model_versions(db: sqlite_utils.Database) -> None:
    ensure_model_versions(db.conn)


# Append only: a migration that shipped never changes (a device's file records how many ran).
MIGRATIONS: list[Migration] = [_m001_core, _m002_deployments, _m003_planes, _m004_model_versions]
