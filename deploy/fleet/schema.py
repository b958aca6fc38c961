"""Tables of the fleet store, for SQLite and PostgreSQL, and the PostgreSQL time partitions.

Column names are the interface agreed with the dashboard (docs/fleet.md). Times are unix seconds as
REAL / DOUBLE PRECISION: `ts` is the device's clock, `received` the collector's. `(device_id, boot_id,
seq)` is unique, so a replay or a redelivered message is stored once. PostgreSQL range-partitions
telemetry and events by day on `ts` (its unique key then has to include `ts`; a duplicate carries the
same `ts`, it was stamped when the sample was produced), or makes them TimescaleDB hypertables where
that extension is installed.

Tables and indexes added after a store was first made (`snapshots`, `events_device_type_ts`) are created by
`_added_tables` on every start, whatever the layout: an existing PostgreSQL store never runs
`create_statements` again.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any

from deploy.fleet.db import FleetDB

log = logging.getLogger(__name__)

DAY_S = 86400.0
SCHEMA_LOCK_ID = 0x45444745464C54  # pg_advisory_xact_lock key of schema changes ("EDGEFLT")

TELEMETRY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("device_id", "TEXT NOT NULL"), ("boot_id", "TEXT NOT NULL"), ("seq", "BIGINT NOT NULL"),
    ("ts", "REAL NOT NULL"), ("received", "REAL NOT NULL"), ("fps", "REAL"), ("frames", "BIGINT"),
    ("dropped_frames", "BIGINT"), ("p50_ms", "REAL"), ("p95_ms", "REAL"), ("p99_ms", "REAL"), ("max_ms", "REAL"),
    ("power_w", "REAL"), ("energy_mj_per_frame", "REAL"), ("soc_temp_c", "REAL"), ("gpu_temp_c", "REAL"),
    ("cpu_util", "REAL"), ("gpu_util", "REAL"), ("gpu_freq_mhz", "REAL"), ("throttled", "BOOLEAN"),
    ("model_name", "TEXT"), ("model_version", "TEXT"), ("precision", "TEXT"), ("replayed", "BOOLEAN NOT NULL"),
    ("payload", "TEXT NOT NULL"),
)
EVENT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("device_id", "TEXT NOT NULL"), ("boot_id", "TEXT NOT NULL"), ("seq", "BIGINT NOT NULL"),
    ("ts", "REAL NOT NULL"), ("received", "REAL NOT NULL"), ("type", "TEXT NOT NULL"), ("deployment_id", "TEXT"),
    ("payload", "TEXT NOT NULL"),
)
DEVICE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("device_id", "TEXT PRIMARY KEY"), ("online", "BOOLEAN"), ("state", "TEXT"), ("state_since", "REAL"),
    ("last_seen", "REAL"), ("boot_id", "TEXT"), ("agent_version", "TEXT"), ("model_name", "TEXT"),
    ("model_version", "TEXT"), ("precision", "TEXT"), ("backend", "TEXT"), ("latency_budget_ms", "REAL"),
    ("module", "TEXT"), ("deployment_state", "TEXT"), ("status_json", "TEXT"), ("meta_json", "TEXT"),
    # Added by the collector: the device clock of the status / meta stored, so an older retained copy
    # arriving late (a second collector, a reconnect) never overwrites a newer one.
    ("status_ts", "REAL"), ("meta_ts", "REAL"), ("deployment_ts", "REAL"),
)
OTHER_TABLES = (
    # One row per device and store epoch (a recreated state.db numbers from 1 again: a new stream).
    "CREATE TABLE IF NOT EXISTS device_streams (device_id TEXT NOT NULL, stream TEXT NOT NULL, "
    "min_seq BIGINT NOT NULL, max_seq BIGINT NOT NULL, received BIGINT NOT NULL, PRIMARY KEY (device_id, stream))",
    "CREATE TABLE IF NOT EXISTS collector_stats (name TEXT PRIMARY KEY, value REAL NOT NULL)",
)
# `device_seq` (the dashboards' and docs' interface) sums the streams so that `max_seq - min_seq + 1 -
# received` is the messages lost on the device over all of them; with one stream it is that stream's row.
DEVICE_SEQ_VIEW = ("CREATE VIEW device_seq AS SELECT device_id, MIN(min_seq) AS min_seq, "
                   "CAST(MIN(min_seq) + SUM(max_seq - min_seq + 1) - 1 AS BIGINT) AS max_seq, "
                   "CAST(SUM(received) AS BIGINT) AS received FROM device_streams GROUP BY device_id")
# The newest snapshot (JPEG) per device and camera, nothing older: an upsert keyed by (device_id, camera)
# that an older `ts` never wins, and at most MAX_SNAPSHOT_CAMERAS rows per device (deploy.fleet.writer).
SNAPSHOT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("device_id", "TEXT NOT NULL"), ("camera", "TEXT NOT NULL"), ("ts", "REAL NOT NULL"), ("captured_at", "REAL"),
    ("received", "REAL NOT NULL"), ("frame", "BIGINT"), ("width", "INTEGER NOT NULL"), ("height", "INTEGER NOT NULL"),
    ("overlay", "BOOLEAN NOT NULL"), ("reason", "TEXT NOT NULL"), ("request_id", "TEXT"), ("model", "TEXT"),
    ("bytes", "INTEGER NOT NULL"), ("jpeg", "BLOB NOT NULL"),
)
ADDED_TABLES = (
    ("snapshots", SNAPSHOT_COLUMNS, "PRIMARY KEY (device_id, camera)"),
)
# Indexes added after a store was first made, created at every start like ADDED_TABLES. Each device's newest
# event of one type (its shadow deployment's newest report, the dashboard's shadow column, the shadow gate) is
# then one index probe: on (device_id, ts) alone, a device that never shadowed had all its events read.
ADDED_INDEXES = (
    "CREATE INDEX IF NOT EXISTS events_device_type_ts ON events (device_id, type, ts)",
)
INDEXES = (
    "CREATE INDEX IF NOT EXISTS telemetry_device_ts ON telemetry (device_id, ts)",
    "CREATE INDEX IF NOT EXISTS telemetry_model_ts ON telemetry (model_name, ts)",
    "CREATE INDEX IF NOT EXISTS events_device_ts ON events (device_id, ts)",
    "CREATE INDEX IF NOT EXISTS events_deployment ON events (deployment_id)",
)
TIME_TABLES = ("telemetry", "events")


def _pg_type(sql_type: str) -> str:
    return sql_type.replace("REAL", "DOUBLE PRECISION").replace("BLOB", "BYTEA")


def _columns(columns: tuple[tuple[str, str], ...], dialect: str) -> str:
    return ", ".join(f"{name} {_pg_type(kind) if dialect == 'postgresql' else kind}" for name, kind in columns)


def create_statements(dialect: str, partitioned: bool = False) -> list[str]:
    """CREATE TABLE/INDEX statements for `dialect`; `partitioned` makes telemetry/events day-partitioned."""
    key = "UNIQUE (device_id, boot_id, seq, ts)" if partitioned else "UNIQUE (device_id, boot_id, seq)"
    tail = " PARTITION BY RANGE (ts)" if partitioned else ""
    out = [f"CREATE TABLE IF NOT EXISTS {name} ({_columns(cols, dialect)}, {key}){tail}"
           for name, cols in (("telemetry", TELEMETRY_COLUMNS), ("events", EVENT_COLUMNS))]
    out.append(f"CREATE TABLE IF NOT EXISTS devices ({_columns(DEVICE_COLUMNS, dialect)})")
    out += list(OTHER_TABLES)
    if partitioned:  # rows with a day outside the managed window land here instead of failing the batch
        out += [f"CREATE TABLE IF NOT EXISTS {t}_default PARTITION OF {t} DEFAULT" for t in TIME_TABLES]
    return out + list(INDEXES) + added_statements(dialect)


def added_statements(dialect: str) -> list[str]:
    """CREATE TABLE/INDEX IF NOT EXISTS of what was added since the first layout (run at every start)."""
    tables = [
        f"CREATE TABLE IF NOT EXISTS {name} ({_columns(cols, dialect)}, {key})" for name, cols, key in ADDED_TABLES
    ]
    return tables + list(ADDED_INDEXES)


def ensure_schema(db: FleetDB, *, timescale: str = "auto", retention_days: float = 30.0) -> str:
    """Create what is missing; returns the layout: "sqlite", "partitioned" or "timescaledb"."""
    if db.dialect == "sqlite":
        with db.transaction():
            for sql in create_statements("sqlite"):
                db.execute(sql)
            _device_seq_view(db)  # create_statements holds the added tables too
        return "sqlite"
    with db.transaction():
        # Collectors starting together on a fresh database would race in CREATE ... IF NOT EXISTS
        # (PostgreSQL then fails one of them on pg_type's unique index): one at a time.
        db.query("SELECT pg_advisory_xact_lock(?) AS locked", (SCHEMA_LOCK_ID,))
        layout = existing_layout(db)
        if layout is None and timescale != "off" and _timescale_available(db):
            layout = _try_timescale(db, retention_days)
        if layout is None:
            for sql in create_statements("postgresql", partitioned=True):
                db.execute(sql)
            layout = "partitioned"
        _device_seq_view(db)
        _added_tables(db)
    return layout


def _added_tables(db: FleetDB) -> None:
    """The migration of a store made before `snapshots` (or an added index) existed: create what is missing
    (idempotent; inside ensure_schema's transaction, under its advisory lock on PostgreSQL). A dashboard role
    granted SELECT on the tables that existed then needs the grant again for the new one (docs/dashboard.md).
    A new index on a large PostgreSQL `events` is built once, at the first start after an upgrade, and holds
    that collector's writes while it builds."""
    for sql in added_statements(db.dialect):
        db.execute(sql)


def _device_seq_view(db: FleetDB) -> None:
    """device_streams exists and device_seq is its summing view. A store from before store epochs had a
    device_seq table: its rows become each device's legacy stream ("") and the table gives way to the view."""
    db.execute(OTHER_TABLES[0])
    kind = _relation_kind(db, "device_seq")
    if kind == "table":
        db.execute("INSERT INTO device_streams (device_id, stream, min_seq, max_seq, received) "
                   "SELECT device_id, '', min_seq, max_seq, received FROM device_seq WHERE 1 = 1 "
                   "ON CONFLICT (device_id, stream) DO NOTHING")
        db.execute("DROP TABLE device_seq")
        log.info("device_seq moved into device_streams (one stream per device and store epoch)")
    if kind != "view":
        db.execute(DEVICE_SEQ_VIEW)


def _relation_kind(db: FleetDB, name: str) -> str | None:
    """'table', 'view' or None for a relation of the current schema."""
    if db.dialect == "sqlite":
        rows = db.query("SELECT type FROM sqlite_master WHERE name = ?", (name,))
        return rows[0]["type"] if rows else None
    kind = _pg_relkind(db, name)
    return None if kind is None else "view" if kind == "v" else "table"


def _pg_relkind(db: FleetDB, name: str) -> str | None:
    """PostgreSQL's relkind of `name` in the current schema ('r' table, 'p' partitioned, 'v' view), or None."""
    rows = db.query("SELECT c.relkind AS kind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE c.relname = ? AND n.nspname = current_schema()", (name,))
    return rows[0]["kind"] if rows else None


def existing_layout(db: FleetDB) -> str | None:
    """How an existing PostgreSQL store was made (None: no telemetry table yet)."""
    kind = _pg_relkind(db, "telemetry")
    if kind is None:
        return None
    if kind == "p":
        return "partitioned"
    return "timescaledb" if _is_hypertable(db) else "plain"


def _is_hypertable(db: FleetDB) -> bool:
    try:
        return bool(db.query("SELECT 1 FROM timescaledb_information.hypertables WHERE hypertable_name = 'telemetry'"))
    except Exception:  # noqa: BLE001 - no timescaledb schema: not a hypertable
        return False


def _timescale_available(db: FleetDB) -> bool:
    return bool(db.query("SELECT 1 FROM pg_available_extensions WHERE name = 'timescaledb'"))


def _try_timescale(db: FleetDB, retention_days: float) -> str | None:
    """Hypertables chunked by day on `ts` (seconds -> microseconds), with a retention policy; None on failure."""
    try:
        with db.transaction():
            db.execute("CREATE EXTENSION IF NOT EXISTS timescaledb")
            db.execute("CREATE OR REPLACE FUNCTION fleet_ts_us(ts DOUBLE PRECISION) RETURNS BIGINT "
                       "LANGUAGE SQL IMMUTABLE AS 'SELECT (ts * 1000000)::BIGINT'")
            for sql in create_statements("postgresql"):
                db.execute(sql.replace("UNIQUE (device_id, boot_id, seq)", "UNIQUE (device_id, boot_id, seq, ts)"))
            for table in TIME_TABLES:
                db.query(f"SELECT create_hypertable('{table}', 'ts', chunk_time_interval => 86400000000, "
                         "time_partitioning_func => 'fleet_ts_us', if_not_exists => TRUE)")
                if retention_days > 0:
                    db.query(f"SELECT add_retention_policy('{table}', BIGINT '{int(retention_days * DAY_S * 1e6)}', "
                             "if_not_exists => TRUE)")
        return "timescaledb"
    except Exception as exc:  # noqa: BLE001 - fall back to native partitioning, and say why
        log.warning("TimescaleDB is installed but hypertables could not be set up (%s); "
                    "using native PostgreSQL partitions", exc)
        return None


RETENTION_CHUNK = 5000  # rows one retention DELETE takes on SQLite (short write locks: the collector keeps writing)


def prune_sqlite(db: FleetDB, retention_days: float, now: float | None = None) -> int:
    """SQLite's retention, PostgreSQL's rule: telemetry and events older than `retention_days` by the device
    clock, or received longer ago than that by the collector's (which a device cannot skew), are deleted, in
    chunks of RETENTION_CHUNK rows per transaction. Returns how many."""
    if retention_days <= 0:
        return 0
    cutoff = (time.time() if now is None else now) - retention_days * DAY_S
    deleted = 0
    for table in TIME_TABLES:
        while True:
            with db.transaction():
                n = db.execute(f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} WHERE ts < ? OR "
                               f"received < ? LIMIT {RETENTION_CHUNK})", (cutoff, cutoff))
            deleted += n
            if n < RETENTION_CHUNK:
                break
    if deleted:
        log.info("deleted %d rows past %s days of retention", deleted, retention_days)
    return deleted


def partition_name(table: str, day: int) -> str:
    """`telemetry_p20261201` for unix day `day` (UTC)."""
    return f"{table}_p{datetime.fromtimestamp(day * DAY_S, tz=timezone.utc):%Y%m%d}"


class Partitions:
    """Creates day partitions ahead of the rows that need them and drops those past retention."""

    def __init__(self, db: FleetDB, retention_days: float, *, ahead_days: int = 2,
                 clock: Any = time.time) -> None:
        self.db, self.retention_days, self.ahead_days, self.clock = db, retention_days, ahead_days, clock
        self.known: set[tuple[str, int]] = set()
        self.errors = 0

    def window(self) -> tuple[int, int]:
        """Days (inclusive) for which partitions are made; others go to the default partition."""
        today = int(self.clock() // DAY_S)
        back = int(self.retention_days) if self.retention_days > 0 else 366
        return today - back, today + self.ahead_days

    def ensure(self, table: str, timestamps: list[float]) -> None:
        """Make the partitions of the days in `timestamps` (inside the window) exist."""
        low, high = self.window()
        for day in {int(ts // DAY_S) for ts in timestamps}:
            if low <= day <= high and (table, day) not in self.known:
                self._create(table, day)

    def _create(self, table: str, day: int) -> None:
        name = partition_name(table, day)
        try:
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF {table} "
                            f"FOR VALUES FROM ({day * DAY_S}) TO ({(day + 1) * DAY_S})")
        except Exception as exc:  # noqa: BLE001 - the row still lands in the default partition
            if not self._exists(name):
                self.errors += 1
                log.warning("partition %s not created (rows of that day stay in %s_default): %s", name, table, exc)
        self.known.add((table, day))

    def _exists(self, name: str) -> bool:
        return bool(self.db.query("SELECT 1 FROM pg_class WHERE relname = ?", (name,)))

    def drop_expired(self) -> list[str]:
        """Drop day partitions wholly older than the retention; returns their names."""
        if self.retention_days <= 0:
            return []
        cutoff = partition_name("x", int(self.clock() // DAY_S) - int(self.retention_days))[3:]
        dropped = []
        for table in TIME_TABLES:
            rows = self.db.query("SELECT c.relname AS name FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                                 "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = ?", (table,))
            for name in sorted(r["name"] for r in rows):
                suffix = name[len(table) + 2:]
                if name.startswith(f"{table}_p") and suffix.isdigit() and suffix < cutoff:
                    self.db.execute(f"DROP TABLE IF EXISTS {name}")
                    self.known = {k for k in self.known if partition_name(k[0], k[1]) != name}
                    dropped.append(name)
        if dropped:
            log.info("dropped partitions past %s days of retention: %s", self.retention_days, ", ".join(dropped))
        self.prune_default()
        return dropped

    def prune_default(self) -> int:
        """Delete the default partitions' rows past retention; returns how many.

        Rows land there when the device clock is outside the window of day partitions, and no partition
        drop ever reaches them: a far-past `ts` is past retention already; a far-future one is kept until
        it was *received* longer ago than the retention (the collector's clock, which a device cannot skew).
        """
        if self.retention_days <= 0:
            return 0
        cutoff = self.clock() - self.retention_days * DAY_S
        deleted = 0
        for table in TIME_TABLES:
            deleted += self.db.execute(f"DELETE FROM {table}_default WHERE ts < ? OR received < ?", (cutoff, cutoff))
        if deleted:
            log.info("deleted %d rows past %s days of retention from the default partitions", deleted,
                     self.retention_days)
        return deleted
