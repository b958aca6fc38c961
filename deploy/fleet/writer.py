"""One batch of messages into the fleet store, in one transaction: rows, per-device seq counts, device
rows and the collector's counters commit together or not at all.

Exactly once per (device_id, boot_id, seq): rows go in with ON CONFLICT DO NOTHING, and only the rows
really inserted count towards `device_streams.received`, so a replay or a redelivery changes nothing.
Snapshots keep the newest per (device_id, camera) only: an upsert that an older `ts` never wins, and at
most `snapshot_cameras` rows per device (the device's oldest go), so one device's images stay bounded.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from deploy.fleet.db import FleetDB
from deploy.fleet.records import FUTURE_TS_S, STATUS, DeviceUpdate, Row, SnapshotRecord
from deploy.fleet.schema import EVENT_COLUMNS, SNAPSHOT_COLUMNS, TELEMETRY_COLUMNS

COLUMNS = {"telemetry": [c for c, _ in TELEMETRY_COLUMNS], "events": [c for c, _ in EVENT_COLUMNS]}
# Rows per multi-row statement: 500 x 25 columns stays under SQLite's 32766 and PostgreSQL's 65535
# parameters, and one statement per table per batch instead of one per row is most of the batching gain.
CHUNK_ROWS = 500
SNAPSHOT_CAMERAS = 16  # snapshot rows kept per device at most (the default of `edge-deploy collect --snapshot-cameras`)
_SNAPSHOT_NAMES = [c for c, _ in SNAPSHOT_COLUMNS]
_SNAPSHOT_KEY = ("device_id", "camera")
# Newer or as new (a redelivery writes the same image again) replaces; older leaves the stored one.
_UPSERT_SNAPSHOT = (
    f"INSERT INTO snapshots ({', '.join(_SNAPSHOT_NAMES)}) VALUES ({', '.join('?' * len(_SNAPSHOT_NAMES))}) "
    "ON CONFLICT (device_id, camera) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _SNAPSHOT_NAMES if c not in _SNAPSHOT_KEY)
    + " WHERE excluded.ts >= snapshots.ts"
)
_TRIM_SNAPSHOTS = ("DELETE FROM snapshots WHERE device_id = ? AND camera NOT IN (SELECT camera FROM snapshots "
                   "WHERE device_id = ? ORDER BY ts DESC, camera LIMIT ?)")


@dataclass
class BatchResult:
    """What one committed batch changed."""

    inserted: Counter[str] = field(default_factory=Counter)  # per table
    duplicates: int = 0
    devices: int = 0
    snapshots: Counter[str] = field(default_factory=Counter)  # snapshots_stored, snapshots_stale, snapshots_trimmed


def write_batch(db: FleetDB, rows: list[Row], updates: list[DeviceUpdate], stats: dict[str, float],
                received: float, snapshots: Iterable[SnapshotRecord] = (),
                snapshot_cameras: int = SNAPSHOT_CAMERAS) -> BatchResult:
    """Store the batch and add `stats` to collector_stats, atomically."""
    result = BatchResult()
    snapshots = list(snapshots)
    unique = list({row.key + (row.table,): row for row in rows}.values())
    result.duplicates = len(rows) - len(unique)
    with db.transaction():
        fresh = _drop_stored_clamped(db, unique)
        result.duplicates += len(unique) - len(fresh)
        unique = fresh
        new = _insert_rows(db, unique)
        result.duplicates += len(unique) - len(new)
        result.inserted.update(row.table for row in new)
        _count_seqs(db, new)
        result.snapshots = _upsert_snapshots(db, snapshots, snapshot_cameras)
        heard = {row.device_id for row in new} | {snap.device_id for snap in snapshots}
        result.devices = _touch_devices(db, new, received, heard) + _apply_updates(db, updates, received)
        _add_stats(db, {**stats, "duplicates": stats.get("duplicates", 0) + result.duplicates,
                        **{f"inserted_{t}": n + stats.get(f"inserted_{t}", 0) for t, n in result.inserted.items()},
                        **{name: n + stats.get(name, 0) for name, n in result.snapshots.items()}})
    return result


def _upsert_snapshots(db: FleetDB, snapshots: list[SnapshotRecord], cameras: int) -> Counter[str]:
    """The newest snapshot of each (device, camera) of the batch upserted, then each device trimmed to its
    `cameras` newest rows. Counts what was stored, what lost to a newer one (in the batch or stored) and
    what the bound deleted."""
    counts: Counter[str] = Counter()
    newest: dict[tuple[str, str], SnapshotRecord] = {}
    for snap in snapshots:  # arrival order: of two with one `ts`, the later one wins, as in the table
        key = (snap.device_id, snap.camera)
        if key not in newest or snap.ts >= newest[key].ts:
            newest[key] = snap
    counts["snapshots_stale"] += len(snapshots) - len(newest)
    for key in sorted(newest):  # sorted: collectors lock rows in one order
        changed = db.execute(_UPSERT_SNAPSHOT, [newest[key].values[c] for c in _SNAPSHOT_NAMES])
        counts["snapshots_stored" if changed else "snapshots_stale"] += 1
    for device_id in sorted({device_id for device_id, _ in newest}):
        counts["snapshots_trimmed"] += max(0, db.execute(_TRIM_SNAPSHOTS, (device_id, device_id, int(cameras))))
    return +counts


def _drop_stored_clamped(db: FleetDB, rows: list[Row]) -> list[Row]:
    """Rows whose future `ts` was clamped to the receive time carry a new `ts` on each redelivery, and on
    PostgreSQL's partitioned tables `ts` is part of the unique key: such a row is looked up by
    (device_id, boot_id, seq) first (rare: one lookup per clamped row) and left out when already stored."""
    clamped = [row for row in rows if row.clamped]
    if not clamped:
        return rows
    stored = set()
    for row in clamped:
        if db.query(f"SELECT 1 AS x FROM {row.table} WHERE device_id = ? AND boot_id = ? AND seq = ? LIMIT 1",
                    (row.device_id, row.boot_id, row.seq)):
            stored.add(id(row))
    return [row for row in rows if id(row) not in stored]


def _insert_rows(db: FleetDB, rows: list[Row]) -> list[Row]:
    """Insert with multi-row statements, skipping keys already stored; returns the rows that were new."""
    new: list[Row] = []
    for table, cols in COLUMNS.items():
        mine = [row for row in rows if row.table == table]
        chunks = [mine] if db.dialect == "postgresql" and mine else _chunks(mine)
        for chunk in chunks:
            got = db.query(*_insert_sql(db.dialect, table, cols, chunk))
            keys = {(r["device_id"], r["boot_id"], r["seq"]) for r in got}
            new += [row for row in chunk if row.key in keys]
    return new


def _insert_sql(dialect: str, table: str, cols: list[str], chunk: list[Row]) -> tuple[str, list[Any]]:
    """PostgreSQL gets the whole batch as ONE json parameter (json_populate_recordset): binding 25
    parameters per row costs the client ~150 us a row in psycopg, one JSON text ~5 us. SQLite binds
    parameters in C, so plain multi-row VALUES."""
    tail = "ON CONFLICT DO NOTHING RETURNING device_id, boot_id, seq"
    names = ", ".join(cols)
    if dialect == "postgresql":
        data = json.dumps([{c: row.values[c] for c in cols} for row in chunk], allow_nan=False)
        return (f"INSERT INTO {table} ({names}) SELECT {names} FROM json_populate_recordset(NULL::{table}, ?::json) "
                f"{tail}", [data])
    return (f"INSERT INTO {table} ({names}) VALUES {_values(len(cols), len(chunk))} {tail}",
            [row.values[c] for row in chunk for c in cols])


def _chunks(items: list[Any]) -> Iterable[list[Any]]:
    for start in range(0, len(items), CHUNK_ROWS):
        yield items[start:start + CHUNK_ROWS]


def _values(width: int, count: int) -> str:
    """`(?, ?), (?, ?)` for `count` rows of `width` columns."""
    one = "(" + ", ".join("?" * width) + ")"
    return ", ".join([one] * count)


def _count_seqs(db: FleetDB, rows: Iterable[Row]) -> None:
    """device_streams: lowest and highest seq seen and how many rows were stored, per device and store epoch
    (one statement); the device_seq view sums the streams."""
    per: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        low, high, n = per.get((row.device_id, row.stream), [row.seq, row.seq, 0])
        per[(row.device_id, row.stream)] = [min(low, row.seq), max(high, row.seq), n + 1]
    least, greatest = ("LEAST", "GREATEST") if db.dialect == "postgresql" else ("MIN", "MAX")
    spec = (("device_id", "TEXT"), ("stream", "TEXT"), ("min_seq", "BIGINT"), ("max_seq", "BIGINT"),
            ("received", "BIGINT"))
    rows_ = [(device_id, stream, low, high, n) for (device_id, stream), (low, high, n) in sorted(per.items())]
    for source, params in _sources(db.dialect, spec, rows_):  # sorted: collectors lock rows in one order
        db.execute(f"INSERT INTO device_streams (device_id, stream, min_seq, max_seq, received) {source} "
                   "ON CONFLICT (device_id, stream) DO UPDATE SET "
                   f"min_seq = {least}(device_streams.min_seq, excluded.min_seq), "
                   f"max_seq = {greatest}(device_streams.max_seq, excluded.max_seq), "
                   "received = device_streams.received + excluded.received", params)


def _sources(dialect: str, spec: tuple[tuple[str, str], ...], rows: list[tuple]) -> Iterable[tuple[str, list]]:
    """Row sources for `INSERT INTO t (cols) <source>`: one JSON parameter on PostgreSQL (see
    _insert_sql), multi-row VALUES chunks on SQLite."""
    if not rows:
        return
    if dialect == "postgresql":
        names = ", ".join(name for name, _ in spec)
        types = ", ".join(f"{name} {kind}" for name, kind in spec)
        data = json.dumps([dict(zip((n for n, _ in spec), row)) for row in rows], allow_nan=False)
        yield f"SELECT {names} FROM json_to_recordset(?::json) AS x({types})", [data]
        return
    for chunk in _chunks(rows):
        yield f"VALUES {_values(len(spec), len(chunk))}", [v for row in chunk for v in row]


def _touch_devices(db: FleetDB, rows: list[Row], received: float, heard: Iterable[str] = ()) -> int:
    """last_seen for every device heard from (`rows`' and `heard`), and deployment_state from `deployment`
    events."""
    greatest = "GREATEST" if db.dialect == "postgresql" else "MAX"
    devices = sorted({row.device_id for row in rows} | set(heard))
    spec = (("device_id", "TEXT"), ("last_seen", "DOUBLE PRECISION"))
    for source, params in _sources(db.dialect, spec, [(device_id, received) for device_id in devices]):
        db.execute(f"INSERT INTO devices (device_id, last_seen) {source} ON CONFLICT (device_id) DO UPDATE "
                   f"SET last_seen = {greatest}(COALESCE(devices.last_seen, 0), excluded.last_seen)", params)
    for row in rows:
        if row.table == "events" and row.values.get("deployment_state") is not None:
            _deployment_state(db, row, row.values["deployment_state"])
    return len(devices)


def _deployment_state(db: FleetDB, row: Row, state: str) -> None:
    """The newest deployment step (by device clock) wins, whatever order the events arrive in."""
    db.execute("UPDATE devices SET deployment_state = ?, deployment_ts = ? WHERE device_id = ? "
               "AND (deployment_ts IS NULL OR deployment_ts <= ?)", (state, row.ts, row.device_id, row.ts))


def _apply_updates(db: FleetDB, updates: list[DeviceUpdate], received: float) -> int:
    """Upsert status/meta. A copy older (by device clock) than the one stored is ignored, unless the stored stamp
    is still far in the future (written before stamps were clamped: it would pin the row until then). A Last
    Will always applies and keeps the stored stamp when that is newer: its own `ts` is from when the device
    connected, older than every status of that connection, yet the will is the last word of that connection."""
    greatest = "GREATEST" if db.dialect == "postgresql" else "MAX"
    for update in updates:
        stamp = "status_ts" if update.leaf == STATUS else "meta_ts"
        values = {**update.values, stamp: update.ts}
        cols = list(values)
        insert = (f"INSERT INTO devices (device_id, {', '.join(cols)}) VALUES ({', '.join('?' * (len(cols) + 1))}) "
                  "ON CONFLICT (device_id) DO UPDATE SET ")
        sets = ", ".join(f"{c} = excluded.{c}" for c in cols if c != stamp)
        params: tuple[Any, ...] = (update.device_id, *values.values())
        if update.is_will:
            sql = (f"{insert}{sets}, {stamp} = {greatest}(COALESCE(devices.{stamp}, excluded.{stamp}), "
                   f"COALESCE(excluded.{stamp}, devices.{stamp}))")
        else:
            sql = (f"{insert}{sets}, {stamp} = excluded.{stamp} WHERE devices.{stamp} IS NULL OR excluded.{stamp} "
                   f"IS NULL OR excluded.{stamp} >= devices.{stamp} OR devices.{stamp} > ?")
            params += (received + FUTURE_TS_S,)
        db.execute(sql, params)
    return len(updates)


def _add_stats(db: FleetDB, stats: dict[str, float]) -> None:
    sql = ("INSERT INTO collector_stats (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE "
           "SET value = collector_stats.value + excluded.value")
    for name, value in sorted(stats.items()):
        if value:
            db.execute(sql, (name, float(value)))
