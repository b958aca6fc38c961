"""The fleet store without a broker: device messages parsed into rows (or refused as malformed), and the rows
written once each, against real SQLite files and a real PostgreSQL server (partitions, retention, the schema
made once by collectors starting together).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from deploy.fleet.db import FleetDBError, open_db, to_pyformat
from deploy.fleet.records import Malformed, parse_message
from deploy.fleet.schema import ensure_schema
from deploy.fleet.writer import write_batch
from tests.fleet_collector_helpers import (BOOT, count, query, sample)


# ---- parsing (no I/O) ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("payload", "why"), [
    (b"not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "expected an object"),
    (json.dumps({"boot_id": BOOT, "ts": 1.0}).encode(), "'seq'"),
    (json.dumps({"seq": "7", "boot_id": BOOT, "ts": 1.0}).encode(), "'seq'"),
    (json.dumps({"seq": True, "boot_id": BOOT, "ts": 1.0}).encode(), "'seq'"),
    (json.dumps({"seq": 2**64, "boot_id": BOOT, "ts": 1.0}).encode(), "'seq'"),
    (json.dumps({"seq": 1, "boot_id": 5, "ts": 1.0}).encode(), "'boot_id'"),
    (json.dumps({"seq": 1, "boot_id": BOOT, "ts": "yesterday"}).encode(), "'ts'"),
    (b'{"seq": 1, "boot_id": "b", "ts": NaN}', "not JSON"),
    (b"[" * 100000 + b"]" * 100000, "not JSON"),
    # json.loads(bytes) would accept these encodings; the store keeps UTF-8 text only.
    (json.dumps({"seq": 1, "boot_id": BOOT, "ts": 1.0}).encode("utf-16"), "not UTF-8"),
    (json.dumps({"seq": 1, "boot_id": BOOT, "ts": 1.0}).encode("utf-32"), "not UTF-8"),
    (json.dumps({"seq": 1, "boot_id": BOOT, "ts": 1.0}).encode("utf-16-le"), "not JSON"),  # ASCII + NULs: valid UTF-8
    (b"\xef\xbb\xbf" + json.dumps({"seq": 1, "boot_id": BOOT, "ts": 1.0}).encode(), "not JSON"),
    (b'"a string"', "expected an object"),
    (b"null", "expected an object"),
    (b"1e999", "expected an object"),
    (b'{"seq": 1, "boot_id": "b", "ts": Infinity}', "not JSON"),
    (b'{"seq": 1, "boot_id": "b", "ts": 1e999}', "'ts'"),
    (b'{"a": ' * 20000 + b"1" + b"}" * 20000, "not JSON"),  # nested past the recursion limit
])
def test_unkeyable_telemetry_is_malformed(payload: bytes, why: str) -> None:
    with pytest.raises(Malformed, match=why):
        parse_message("edge", "edge/dev-1/telemetry", payload, 0.0)


def test_oversized_payload_is_malformed() -> None:
    big = json.dumps(sample(1, note="x" * 300_000)).encode()
    with pytest.raises(Malformed, match="exceeds"):
        parse_message("edge", "edge/dev-1/telemetry", big, 0.0, max_bytes=256 * 1024)


def test_wrong_types_become_null_and_text_is_kept_verbatim() -> None:
    body = sample(3, fps="fast", frames=2**70, gpu_util=True, throttled="yes", cpu_util=float("1e308"),
                  latency_ms=[1, 2], model={"name": "<script>alert(1)</script>", "version": 2},
                  temp_c={"gpu": "hot", "cpu": 40})
    row = parse_message("edge", "edge/dev-1/telemetry", json.dumps(body).encode(), 5.0)
    v = row.values
    assert (v["fps"], v["frames"], v["gpu_util"], v["throttled"], v["p99_ms"]) == (None, None, None, None, None)
    assert v["model_name"] == "<script>alert(1)</script>" and v["model_version"] is None
    assert (v["soc_temp_c"], v["gpu_temp_c"], v["cpu_util"]) == (40.0, None, 1e308)
    assert json.loads(v["payload"]) == body and v["replayed"] is False


def test_absent_fields_are_null_never_zero() -> None:
    row = parse_message("edge", "edge/dev-1/telemetry", json.dumps({"seq": 1, "boot_id": BOOT, "ts": 9.0}).encode(), 1)
    assert all(row.values[k] is None for k in ("fps", "frames", "power_w", "soc_temp_c", "throttled", "p50_ms"))


def test_to_pyformat_leaves_quoted_text_alone() -> None:
    assert to_pyformat("SELECT '?', \"a%\" FROM t WHERE a = ? AND b LIKE 'x%'") == \
        "SELECT '?', \"a%%\" FROM t WHERE a = %s AND b LIKE 'x%%'"


def test_open_db_refuses_bad_urls(tmp_path: Path) -> None:
    for url in ("mysql://x/y", "sqlite://relative.db", "sqlite:///"):
        with pytest.raises(FleetDBError, match="URL"):
            open_db(url)


# ---- the store ----------------------------------------------------------------------------------------

def _rows(seqs: list[int], device: str = "dev-1", **extra: Any) -> list:
    return [parse_message("edge", f"edge/{device}/telemetry", json.dumps(sample(s, device, **extra)).encode(), 1.0)
            for s in seqs]


def test_store_keeps_each_seq_once_and_counts_gaps(fleet_db_url: str) -> None:
    db = open_db(fleet_db_url)
    try:
        ensure_schema(db)
        ensure_schema(db)  # idempotent
        first = write_batch(db, _rows([1, 2, 2, 3, 5]), [], {"malformed": 2}, 10.0)
        again = write_batch(db, _rows([3, 5, 6], replayed=True), [], {}, 11.0)
        assert (first.inserted["telemetry"], first.duplicates) == (4, 1)
        assert (again.inserted["telemetry"], again.duplicates) == (1, 2)
        seq = db.query("SELECT min_seq, max_seq, received FROM device_seq WHERE device_id = ?", ("dev-1",))[0]
        assert (seq["min_seq"], seq["max_seq"], seq["received"]) == (1, 6, 5)
        assert seq["max_seq"] - seq["min_seq"] + 1 - seq["received"] == 1  # seq 4: lost on the device
        stats = {r["name"]: r["value"] for r in db.query("SELECT name, value FROM collector_stats")}
        assert (stats["duplicates"], stats["malformed"], stats["inserted_telemetry"]) == (3, 2, 5)
        row = db.query("SELECT * FROM telemetry WHERE seq = ?", (6,))[0]
        assert (row["power_w"], row["soc_temp_c"], row["gpu_temp_c"], bool(row["replayed"])) == (7.5, 52.5, 49.5, True)
        assert db.query("SELECT last_seen FROM devices")[0]["last_seen"] == 11.0
    finally:
        db.close()


def test_a_recreated_device_store_is_a_new_stream_not_duplicates(fleet_db_url: str) -> None:
    """After a state.db quarantine the device numbers from seq 1 again under the same kernel boot, with a new
    store epoch (agent.mqtt.outbox): every message is stored, and lost-on-device counts each stream's gaps."""
    db = open_db(fleet_db_url)
    try:
        ensure_schema(db)
        write_batch(db, _rows([1, 2, 3, 4, 5]), [], {}, 10.0)  # a store from before epochs: no `epoch`
        write_batch(db, _rows([1, 2, 4], epoch=7), [], {}, 11.0)  # the recreated store: seq 3 dropped on the device
        write_batch(db, _rows([1, 2], epoch=7), [], {}, 12.0)  # redelivered: stored once
        assert db.query("SELECT COUNT(*) AS n FROM telemetry")[0]["n"] == 8
        streams = {r["stream"]: (r["min_seq"], r["max_seq"], r["received"])
                   for r in db.query("SELECT stream, min_seq, max_seq, received FROM device_streams")}
        assert streams == {"": (1, 5, 5), "7": (1, 4, 3)}
        seq = db.query("SELECT min_seq, max_seq, received FROM device_seq WHERE device_id = ?", ("dev-1",))[0]
        assert seq["max_seq"] - seq["min_seq"] + 1 - seq["received"] == 1 and seq["received"] == 8
        boots = {r["boot_id"] for r in db.query("SELECT DISTINCT boot_id FROM telemetry")}
        assert boots == {BOOT, f"{BOOT}#7"}
        for bad in (True, -3, 1.5, "a b", {"x": 1}):
            with pytest.raises(Malformed, match="epoch"):
                _rows([1], epoch=bad)
    finally:
        db.close()


def test_a_store_from_before_streams_keeps_its_counts(fleet_db_url: str) -> None:
    """device_seq was a table: its rows become each device's legacy stream and it becomes the summing view."""
    db = open_db(fleet_db_url)
    try:
        with db.transaction():
            db.execute("CREATE TABLE device_seq (device_id TEXT PRIMARY KEY, min_seq BIGINT NOT NULL, "
                       "max_seq BIGINT NOT NULL, received BIGINT NOT NULL)")
            db.execute("INSERT INTO device_seq VALUES (?, ?, ?, ?)", ("dev-1", 1, 100, 97))
        ensure_schema(db)
        ensure_schema(db)
        seq = db.query("SELECT min_seq, max_seq, received FROM device_seq")[0]
        assert (seq["min_seq"], seq["max_seq"], seq["received"]) == (1, 100, 97)
        write_batch(db, _rows([101, 102]), [], {}, 10.0)
        seq = db.query("SELECT min_seq, max_seq, received FROM device_seq")[0]
        assert (seq["min_seq"], seq["max_seq"], seq["received"]) == (1, 102, 99)
    finally:
        db.close()


def test_status_newest_by_device_clock_wins(fleet_db_url: str) -> None:
    def status(state: str, ts: float) -> Any:
        body = {"state": state, "boot_id": BOOT, "agent_version": "0.1.0", "since": ts - 1, "ts": ts,
                "model": {"name": "det", "version": "2.0.0", "backend": "tensorrt", "latency_budget_ms": 40}}
        return parse_message("edge", "edge/dev-1/status", json.dumps(body).encode(), ts)

    meta = parse_message("edge", "edge/dev-1/meta",
                         json.dumps({"fingerprint": {"module": "orin-nano-8gb"}}).encode(), 1)
    db = open_db(fleet_db_url)
    try:
        ensure_schema(db)
        write_batch(db, [], [status("online", 100.0), meta], {}, 100.0)
        write_batch(db, [], [status("degraded", 90.0)], {}, 101.0)  # an older retained copy, late
        row = db.query("SELECT * FROM devices WHERE device_id = ?", ("dev-1",))[0]
        assert (row["state"], bool(row["online"]), row["module"], row["latency_budget_ms"]) == \
            ("online", True, "orin-nano-8gb", 40.0)
        write_batch(db, [], [status("degraded", 110.0)], {}, 111.0)
        row = db.query("SELECT state, online, agent_version FROM devices")[0]
        assert (row["state"], bool(row["online"]), row["agent_version"]) == ("degraded", True, "0.1.0")
        # The Last Will carries the stamp of its connection's start, older than that connection's statuses: it
        # applies anyway, and keeps the newer stamp, so only a status of a later connection replaces it.
        write_batch(db, [], [status("offline", 95.0)], {}, 112.0)
        row = db.query("SELECT state, online, status_ts FROM devices")[0]
        assert (row["state"], bool(row["online"]), row["status_ts"]) == ("offline", False, 110.0)
        write_batch(db, [], [status("online", 105.0)], {}, 113.0)  # a copy from before the will: still offline
        assert db.query("SELECT state FROM devices")[0]["state"] == "offline"
        write_batch(db, [], [status("online", 120.0)], {}, 121.0)
        assert db.query("SELECT state FROM devices")[0]["state"] == "online"
        # A stamp stored unclamped (by a collector before issue 47) far in the future pins nothing.
        db.execute("UPDATE devices SET status_ts = ?", (10_000_000_000.0,))
        write_batch(db, [], [status("degraded", 130.0)], {}, 131.0)
        assert db.query("SELECT state, status_ts FROM devices")[0] == {"state": "degraded", "status_ts": 130.0}
    finally:
        db.close()


def test_postgres_partitions_by_day_and_drops_expired(postgres_server: Any) -> None:
    from deploy.fleet.schema import Partitions

    url = postgres_server.create_database()
    db = open_db(url)
    try:
        assert ensure_schema(db, timescale="off") == "partitioned"
        now = 1_764_547_200.0  # 2025-12-01 00:00 UTC
        parts = Partitions(db, retention_days=3, clock=lambda: now)
        rows = _rows([1, 2]) + [parse_message("edge", "edge/dev-1/telemetry", json.dumps(
            {**sample(3), "ts": now - 5 * 86400}).encode(), 1.0)]
        rows[0].values["ts"] = rows[0].ts = now - 2 * 86400 + 5
        rows[1].values["ts"] = rows[1].ts = now + 2  # the samples' own clock is the test session's
        parts.ensure("telemetry", [r.ts for r in rows])
        write_batch(db, rows, [], {}, now)
        names = {r["relname"] for r in db.query("SELECT relname FROM pg_class "
                                                 "WHERE relkind = 'r' AND relname LIKE 'telemetry_p%'")}
        assert names == {"telemetry_p20251129", "telemetry_p20251201"}  # 5 days old: default partition
        assert count(url) == 3
        assert Partitions(db, retention_days=1, clock=lambda: now).drop_expired() == ["telemetry_p20251129"]
        assert count(url) == 1  # the 5-day-old row in the default partition went with it
    finally:
        db.close()
        postgres_server.drop_database(url)


def test_postgres_default_partition_is_pruned_at_the_retention_check(postgres_server: Any) -> None:
    """Device clocks far in the past or future put rows in `*_default`, which no partition drop reaches
    (before: it grew forever). Far past: gone at the next check. Far future: kept for the retention
    after it was received (the collector's clock)."""
    from deploy.fleet.schema import Partitions

    url = postgres_server.create_database()
    db = open_db(url)
    try:
        ensure_schema(db, timescale="off")
        now, day = 1_764_547_200.0, 86400.0
        parts = Partitions(db, retention_days=3, clock=lambda: now)

        def row(seq: int, ts: float, received: float, leaf: str = "telemetry") -> Any:
            body = {**sample(seq), "ts": ts, "type": "clock"}
            return parse_message("edge", f"edge/dev-1/{leaf}", json.dumps(body).encode(), received)

        rows = [row(1, 631_152_000.0, now), row(2, 4_102_444_800.0, now - 5 * day),  # 1990; 2100, received 5 days ago
                row(3, 4_102_444_800.0, now - day), row(4, now - 4 * day, now - 4 * day),  # 2100 yesterday; in the past
                row(5, 631_152_000.0, now, "events"), row(6, 4_102_444_800.0, now, "events")]
        write_batch(db, rows, [], {}, now)
        assert query(url, "SELECT COUNT(*) AS n FROM telemetry_default")[0]["n"] == 4
        parts.drop_expired()
        assert sorted(r["seq"] for r in query(url, "SELECT seq FROM telemetry_default")) == [3]
        assert sorted(r["seq"] for r in query(url, "SELECT seq FROM events_default")) == [6]
        later = Partitions(db, retention_days=3, clock=lambda: now + 4 * day)
        assert later.prune_default() == 2 and count(url) == 0 and count(url, "events") == 0
        assert Partitions(db, retention_days=0, clock=lambda: now).prune_default() == 0  # 0 keeps everything
    finally:
        db.close()
        postgres_server.drop_database(url)


def test_collectors_starting_together_create_the_schema_once(postgres_server: Any) -> None:
    """Several collectors opening a fresh PostgreSQL store at the same moment all start (no catalog race)."""
    for _ in range(3):
        url = postgres_server.create_database()
        dbs = [open_db(url) for _ in range(4)]
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(dbs))

        def open_store(db: Any) -> None:
            barrier.wait()
            try:
                ensure_schema(db, timescale="off")
            except Exception as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

        threads = [threading.Thread(target=open_store, args=(db,)) for db in dbs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for db in dbs:
            db.close()
        postgres_server.drop_database(url)
        assert not errors, errors
