"""The fleet collector against a real Mosquitto, real SQLite files and a real PostgreSQL server.

Exactly once per (device_id, boot_id, seq): duplicates and replays stored once, gaps counted as lost on
the device; two collectors splitting one stream; a collector killed with SIGKILL mid-stream losing
nothing; broker and database outages; malformed device messages counted and dropped, never fatal.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import paho.mqtt.client as mqtt
import pytest

from deploy.fleet.collector import Collector, CollectorConfig
from deploy.fleet.db import FleetDBError, open_db, to_pyformat
from deploy.fleet.records import Malformed, parse_message
from deploy.fleet.schema import ensure_schema
from deploy.fleet.writer import write_batch
from tests.fixtures_mqtt import Broker
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
BOOT = "boot-1"


# Device clock of the samples: an hour before the test session, whole seconds. A fixed date would age past
# the collector's 30-day retention one day, and its periodic retention check would then delete the rows a test
# is counting (PostgreSQL prunes the default partition by device time).
SAMPLE_T0 = float(int(time.time()) - 3600)


def sample(seq: int, device: str = "dev-1", **extra: Any) -> dict[str, Any]:
    """A telemetry sample shaped like agent/daemon/telemetry_loop.py's (plus the outbox stamp)."""
    return {"seq": seq, "boot_id": BOOT, "ts": SAMPLE_T0 + seq, "device_id": device, "fps": 29.5,
            "frames": 100 * seq, "dropped_frames": 1, "latency_ms": {"p50": 10.0, "p95": 12.0, "p99": 15.5, "max": 20.0},
            "power_mw": {"total": 7500, "VDD_IN": 7500}, "energy_mj_per_frame": 254.2,
            "temp_c": {"cpu-thermal": 51.0, "gpu-thermal": 49.5, "soc0-thermal": 52.5}, "cpu_util": 35.0,
            "gpu_util": 80.0, "gpu_freq_mhz": 918, "throttled": False,
            "model": {"name": "det", "version": "2.0.0", "precision": "fp16", "backend": "tensorrt"}, **extra}


class Publisher:
    """A device stand-in: publishes QoS 1 JSON (or raw bytes) and waits for the broker's PUBACKs."""

    def __init__(self, url: str) -> None:
        host, port = url.split("://")[1].rsplit(":", 1)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.max_inflight_messages_set(1000)
        self.client.max_queued_messages_set(0)
        self.client.connect(host, int(port))
        self.client.loop_start()

    def send(self, topic: str, body: Any, *, retain: bool = False) -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def send_many(self, items: list[tuple[str, Any]]) -> None:
        infos = [self.client.publish(t, b if isinstance(b, bytes) else json.dumps(b).encode(), qos=1) for t, b in items]
        for info in infos:
            info.wait_for_publish(30)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def publisher(mqtt_broker: Broker) -> Iterator[Publisher]:
    pub = Publisher(mqtt_broker.url)
    yield pub
    pub.close()


@pytest.fixture
def collectors() -> Iterator[list[Collector]]:
    """Collectors made in a test are stopped at its end."""
    made: list[Collector] = []
    yield made
    for collector in made:
        collector.stop()


def start_collector(made: list[Collector], broker_url: str, db_url: str, prefix: str, **kwargs: Any) -> Collector:
    config = CollectorConfig(broker_url=broker_url, db_url=db_url, prefix=prefix,
                             client_id=kwargs.pop("client_id", f"test-{prefix}-{len(made)}"), **kwargs)
    collector = Collector(config)
    made.append(collector)
    collector.start()
    assert wait_for(collector.subscribed.is_set, 10), "collector did not subscribe"
    return collector


def count(url: str, table: str = "telemetry") -> int:
    db = open_db(url)
    try:
        return db.query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"]
    finally:
        db.close()


def query(url: str, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
    db = open_db(url)
    try:
        return db.query(sql, params)
    finally:
        db.close()


def stat(url: str, name: str) -> float:
    rows = query(url, "SELECT value FROM collector_stats WHERE name = ?", (name,))
    return rows[0]["value"] if rows else 0.0


def unique_prefix(request: pytest.FixtureRequest) -> str:
    """A topic prefix per test: the session broker is shared, retained messages must not leak across."""
    return "t" + str(abs(hash(request.node.nodeid)))[:10]


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

    meta = parse_message("edge", "edge/dev-1/meta", json.dumps({"fingerprint": {"module": "orin-nano-8gb"}}).encode(), 1)
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
        names = {r["relname"] for r in db.query("SELECT relname FROM pg_class WHERE relkind = 'r' AND relname LIKE 'telemetry_p%'")}
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


# ---- the collector with a real broker -------------------------------------------------------------------

def test_collects_exactly_once_with_duplicates_replays_and_gaps(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest) -> None:
    p = unique_prefix(request)
    start_collector(collectors, mqtt_broker.url, fleet_db_url, p, max_wait_s=0.05)
    publisher.send(f"{p}/dev-1/status", {"state": "online", "boot_id": BOOT, "ts": 5.0, "since": 1.0}, retain=True)
    seqs = [1, 2, 3, 3, 4, 2, 6, 7]  # 3 and 2 again (a redelivery, a replay), 5 lost on the device
    publisher.send_many([(f"{p}/dev-1/telemetry", sample(s, replayed=s == 2)) for s in seqs])
    publisher.send(f"{p}/dev-1/events", {"seq": 8, "boot_id": BOOT, "ts": 3.0, "type": "deployment",
                                          "deployment_id": "d-1", "state": "active"})
    assert wait_for(lambda: count(fleet_db_url) == 6 and count(fleet_db_url, "events") == 1, 15)
    assert wait_for(lambda: stat(fleet_db_url, "duplicates") == 2, 10)
    seq = query(fleet_db_url, "SELECT min_seq, max_seq, received FROM device_seq")[0]
    assert seq["max_seq"] - seq["min_seq"] + 1 - seq["received"] == 1
    dev = query(fleet_db_url, "SELECT state, deployment_state, last_seen FROM devices")[0]
    assert (dev["state"], dev["deployment_state"]) == ("online", "active") and dev["last_seen"] > 0
    publisher.send(f"{p}/dev-1/status", b"", retain=True)  # clear the retained copy


def test_malformed_messages_are_counted_and_never_stop_the_stream(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest) -> None:
    p = unique_prefix(request)
    collector = start_collector(collectors, mqtt_broker.url, fleet_db_url, p, max_wait_s=0.05)
    topic = f"{p}/dev-1/telemetry"
    junk: list[tuple[str, Any]] = [
        (topic, b"\x00\x01garbage"), (topic, b"[]"), (topic, {"seq": "1", "boot_id": BOOT, "ts": 1}),
        (topic, {**sample(1), "note": "y" * 400_000}),  # larger than max_payload_bytes
        (f"{p}/dev-1/events", {"seq": 2, "boot_id": BOOT, "ts": 1.0}),  # an event without a type
        (f"{p}/dev-1/events", {"seq": 3, "boot_id": BOOT, "ts": 1.0, "type": "x\u0000" + "t" * 5000}),
        (f"{p}/dev-2/events", b'{"seq": 1, "boot_id": "b\\ud800", "ts": 1.0, "type": "lone \\udc00 surrogate"}'),
        # Before: parsed by json.loads(bytes), then payload.decode("utf-8") killed the writer thread.
        (topic, json.dumps(sample(6)).encode("utf-16")), (topic, b"null"), (topic, b'{"a": ' * 5000 + b"}" * 5000),
    ]
    markup = {**sample(4), "fps": "NaN", "model": {"name": "<img src=x onerror=alert(1)>", "version": "'; DROP TABLE"}}
    publisher.send_many(junk + [(topic, markup), (topic, sample(5))])
    assert wait_for(lambda: count(fleet_db_url) == 2 and count(fleet_db_url, "events") == 2, 15)
    assert wait_for(lambda: stat(fleet_db_url, "malformed") == 8, 10)
    assert stat(fleet_db_url, "rejected_by_db") == 0
    row = query(fleet_db_url, "SELECT fps, model_name, model_version FROM telemetry WHERE seq = ?", (4,))[0]
    assert row == {"fps": None, "model_name": "<img src=x onerror=alert(1)>", "model_version": "'; DROP TABLE"}
    etype = query(fleet_db_url, "SELECT type FROM events WHERE device_id = ?", ("dev-1",))[0]["type"]
    assert etype == "x" + "t" * 255  # NUL stripped, capped
    assert query(fleet_db_url, "SELECT type FROM events WHERE device_id = ?", ("dev-2",))[0]["type"] == "lone ? surrogate"
    assert collector.stats()["malformed"] == 8 and collector._writer.is_alive()


def test_a_message_the_parser_fails_on_is_dropped_and_acknowledged(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Any exception of the parser (a bug, not only `Malformed`) costs one message, never the stream."""
    import deploy.fleet.collector as collector_module

    real = collector_module.parse_message

    def parser_with_a_bug(prefix: str, topic: str, payload: bytes, *args: Any) -> Any:
        if b"boom" in payload:
            raise KeyError("a parser bug")
        return real(prefix, topic, payload, *args)

    monkeypatch.setattr(collector_module, "parse_message", parser_with_a_bug)
    p = unique_prefix(request)
    collector = start_collector(collectors, mqtt_broker.url, fleet_db_url, p, max_wait_s=0.05)
    topic = f"{p}/dev-1/telemetry"
    publisher.send_many([(topic, sample(1, note="boom")), (topic, sample(2))])
    assert wait_for(lambda: count(fleet_db_url) == 1, 15)
    assert wait_for(lambda: stat(fleet_db_url, "malformed") == 1, 10)
    assert collector._writer.is_alive() and "parser failed on" in caplog.text


class FailingOnce(Collector):
    """A collector whose first unit of work fails with an error nobody foresaw."""

    failed = 0

    def _process(self, batch: list) -> bool:
        if batch and not self.failed:
            self.failed = 1
            raise RuntimeError("unforeseen")
        return super()._process(batch)


def test_a_failing_batch_never_kills_the_writer(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest) -> None:
    p = unique_prefix(request)
    config = CollectorConfig(broker_url=mqtt_broker.url, db_url=fleet_db_url, prefix=p, client_id=f"once-{p}",
                             max_wait_s=0.05, db_retry_min_s=0.05, db_retry_max_s=0.1)
    collector = FailingOnce(config)
    collectors.append(collector)
    collector.start()
    assert wait_for(collector.subscribed.is_set, 10)
    publisher.send(f"{p}/dev-1/telemetry", sample(1))  # the failing batch: not stored, not acknowledged
    assert wait_for(lambda: collector.stats().get("writer_errors") == 1, 10)
    publisher.send(f"{p}/dev-1/telemetry", sample(2))
    assert wait_for(lambda: count(fleet_db_url) == 1, 15)
    assert collector._writer.is_alive() and collector.stats()["unstored"] == 1
    assert wait_for(lambda: stat(fleet_db_url, "writer_errors") == 1, 10)


def test_two_collectors_split_one_stream(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest) -> None:
    p = unique_prefix(request)
    one = start_collector(collectors, mqtt_broker.url, fleet_db_url, p, group="g1")
    two = start_collector(collectors, mqtt_broker.url, fleet_db_url, p, group="g1")
    sent = [(f"{p}/dev-{d}/telemetry", sample(s, f"dev-{d}")) for s in range(1, 101) for d in range(10)]
    publisher.send_many(sent)
    assert wait_for(lambda: count(fleet_db_url) == 1000, 30), count(fleet_db_url)
    assert wait_for(lambda: one.stats().get("messages", 0) + two.stats().get("messages", 0) == 1000, 10)
    assert one.stats()["messages"] > 0 and two.stats()["messages"] > 0  # split, not copied
    keys = query(fleet_db_url, "SELECT device_id, seq FROM telemetry")
    assert sorted((r["device_id"], r["seq"]) for r in keys) == sorted((f"dev-{d}", s) for s in range(1, 101)
                                                                      for d in range(10))
    assert stat(fleet_db_url, "duplicates") == 0


def test_the_default_client_id_is_made_once_and_outlives_the_host_name(tmp_path: Path, monkeypatch) -> None:
    """A replacement collector must find its session again: the id is generated once and kept in a file, not
    derived from the host name (a renamed host or a new container came back under a new id and left its share
    queued in the old session)."""
    import socket as socket_module

    from deploy.fleet.collector import default_client_id_file, stable_client_id

    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    path = default_client_id_file("g1")
    assert path == tmp_path / "state" / "collector-g1.client-id"
    config = CollectorConfig(broker_url="mqtt://127.0.0.1:1", db_url="sqlite:///x.db", group="g1")
    made = config.effective_client_id()
    assert made.startswith("edge-collector-g1-") and path.read_text().strip() == made
    monkeypatch.setattr(socket_module, "gethostname", lambda: "renamed-host")
    again = CollectorConfig(broker_url="mqtt://127.0.0.1:1", db_url="sqlite:///x.db", group="g1")
    assert again.effective_client_id() == made  # the same instance, whatever the host is called now
    assert stable_client_id(tmp_path / "other.id", "g1") != made  # another instance, another id
    assert CollectorConfig(broker_url="mqtt://127.0.0.1:1", db_url="sqlite:///x.db", group="g1",
                           client_id="given").effective_client_id() == "given"
    (tmp_path / "bad.id").write_text("\x00\x01")
    with pytest.raises(ValueError, match="not a client id"):
        stable_client_id(tmp_path / "bad.id", "g1")


def _session_present(url: str, client_id: str) -> bool:
    """Whether the broker still holds a session for `client_id` (a clean_start=False connect says so)."""
    host, port = url.split("://")[1].rsplit(":", 1)
    flags: list[bool] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.on_connect = lambda c, u, f, rc, p: flags.append(bool(f.session_present))
    client.connect(host, int(port), clean_start=False)
    client.loop_start()
    assert wait_for(lambda: bool(flags), 10)
    client.disconnect()
    client.loop_stop()
    return flags[0]


def test_a_collector_that_leaves_its_group_takes_nothing_with_it(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest) -> None:
    """Issue 19: replacing one of two collectors lost 3,999 of 9,998 messages (the offline member kept being
    dealt its share). `leave` stores the backlog its session holds, unsubscribes, ends the session."""
    p = unique_prefix(request)
    one = start_collector(collectors, mqtt_broker.url, fleet_db_url, p, group="g1", client_id=f"{p}-one")
    start_collector(collectors, mqtt_broker.url, fleet_db_url, p, group="g1", client_id=f"{p}-two")
    batch = lambda first, last: [(f"{p}/dev-{d}/telemetry", sample(s, f"dev-{d}"))  # noqa: E731
                                 for s in range(first, last) for d in range(5)]
    publisher.send_many(batch(1, 101))
    assert wait_for(lambda: count(fleet_db_url) == 500, 30), count(fleet_db_url)
    one.stop()  # away: the broker keeps dealing it messages into its session
    collectors.remove(one)
    publisher.send_many(batch(101, 201))
    assert wait_for(lambda: count(fleet_db_url) >= 550, 30)
    assert count(fleet_db_url) < 1000  # part of the stream sits in the absent member's session
    leaving = Collector(CollectorConfig(broker_url=mqtt_broker.url, db_url=fleet_db_url, prefix=p, group="g1",
                                        client_id=f"{p}-one"))
    assert leaving.leave(idle_s=1.0, timeout_s=60) is True
    assert count(fleet_db_url) == 1000  # its backlog stored before it went
    assert _session_present(mqtt_broker.url, f"{p}-one") is False
    publisher.send_many(batch(201, 301))  # all of it to the member that stayed
    assert wait_for(lambda: count(fleet_db_url) == 1500, 30), count(fleet_db_url)
    assert stat(fleet_db_url, "duplicates") == 0


def test_mqtt_311_falls_back_to_plain_subscriptions(
        mqtt_broker: Broker, publisher: Publisher, collectors: list, tmp_path: Path,
        request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:
    p, url = unique_prefix(request), f"sqlite:///{tmp_path / 'fleet.db'}"
    caplog.set_level(logging.WARNING, logger="deploy.fleet.collector")
    collector = start_collector(collectors, mqtt_broker.url, url, p, protocol="3.1.1")
    assert not any(s.startswith("$share/") for s in collector.subscriptions())
    assert "no shared subscriptions" in caplog.text
    publisher.send(f"{p}/dev-1/telemetry", sample(1))
    assert wait_for(lambda: count(url) == 1, 10)


class Mqtt311Gate:
    """A real Mosquitto seen through a gate that speaks for a 3.1.1-only broker: an MQTT 5 CONNECT gets the
    3.1.1 answer "unacceptable protocol version" (CONNACK return code 1) and the connection is closed, as
    Mosquitto <= 1.5 does; 3.1.1 connections are passed through to the real broker byte for byte."""

    def __init__(self, broker_port: int) -> None:
        self.broker_port, self.refused_v5 = broker_port, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._accept, name="mqtt311-gate", daemon=True)]
        self.threads[0].start()

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self.server.settimeout(0.1)
        while not self.stopping.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                continue
            thread = threading.Thread(target=self._serve, args=(client,), name="mqtt311-gate-conn", daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, client: Any) -> None:
        with client:
            head = client.recv(1024)  # CONNECT: fixed header, remaining length, "\0\4MQTT", level
            start = 2 + next(i for i in range(4) if not head[1 + i] & 0x80)
            if head[start + 6] == 5:
                self.refused_v5 += 1
                client.sendall(b"\x20\x02\x00\x01")
                return
            with socket.create_connection(("127.0.0.1", self.broker_port)) as upstream:
                upstream.sendall(head)
                self._pump(client, upstream)

    def _pump(self, a: Any, b: Any) -> None:
        while not self.stopping.is_set():
            ready, _, _ = select.select([a, b], [], [], 0.1)
            for sock in ready:
                data = sock.recv(65536)
                if not data:
                    return
                (b if sock is a else a).sendall(data)

    def close(self) -> None:
        self.stopping.set()
        self.server.close()
        for thread in self.threads:
            thread.join(5)


def test_mqtt5_refused_falls_back_to_311(
        mqtt_broker: Broker, publisher: Publisher, collectors: list, tmp_path: Path,
        request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:
    p, url = unique_prefix(request), f"sqlite:///{tmp_path / 'fleet.db'}"
    gate = Mqtt311Gate(mqtt_broker.port)
    caplog.set_level(logging.WARNING, logger="deploy.fleet.collector")
    try:
        config = CollectorConfig(broker_url=gate.url, db_url=url, prefix=p, client_id=f"old-{p}")
        collector = Collector(config)
        collectors.append(collector)
        collector.start()
        stop = threading.Event()
        runner = threading.Thread(target=collector.run, args=(stop,))
        runner.start()
        try:
            assert wait_for(collector.subscribed.is_set, 15), caplog.text
        finally:
            stop.set()
            runner.join(5)
        assert gate.refused_v5 >= 1 and collector.protocol == "3.1.1"
        assert "falling back to 3.1.1" in caplog.text and "no shared subscriptions" in caplog.text
        publisher.send(f"{p}/dev-1/telemetry", sample(1))
        assert wait_for(lambda: count(url) == 1, 10)
        collector.stop()
    finally:
        gate.close()


def test_broker_outage_reconnects_and_resubscribes(
        broker_factory: Any, collectors: list, tmp_path: Path) -> None:
    broker = broker_factory()
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    collector = start_collector(collectors, broker.url, url, "edge")
    pub = Publisher(broker.url)
    pub.send("edge/dev-1/telemetry", sample(1))
    pub.close()
    assert wait_for(lambda: count(url) == 1, 10)
    broker.stop()
    assert wait_for(lambda: not collector.connected.is_set(), 10)
    broker.start()
    assert wait_for(collector.subscribed.is_set, 30), "collector did not come back"
    pub = Publisher(broker.url)
    pub.send("edge/dev-1/telemetry", sample(2))
    pub.close()
    assert wait_for(lambda: count(url) == 2, 10)
    assert wait_for(lambda: stat(url, "broker_reconnects") >= 1, 10)


@pytest.mark.allow_leaks  # the restarted PostgreSQL belongs to the session fixture again
def test_database_outage_waits_and_loses_nothing(
        postgres_server: Any, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest) -> None:
    p, url = unique_prefix(request), postgres_server.create_database()
    collector = start_collector(collectors, mqtt_broker.url, url, p, max_wait_s=0.05, db_retry_min_s=0.05,
                                db_retry_max_s=0.5, inflight=10, batch_size=4)
    publisher.send(f"{p}/dev-1/telemetry", sample(1))
    assert wait_for(lambda: count(url) == 1, 10)
    postgres_server.stop()
    try:
        publisher.send_many([(f"{p}/dev-1/telemetry", sample(s)) for s in range(2, 52)])
        assert wait_for(lambda: collector.stats().get("db_retries", 0) >= 2, 15)
        # Bounded memory: nothing is acknowledged, so the broker sends no more than the Receive Maximum.
        assert wait_for(lambda: collector.stats()["held"] == 10, 10), collector.stats()
        assert max(collector.held_high_water, collector.stats()["held"]) == 10
    finally:
        postgres_server.start()
    assert wait_for(lambda: count(url) == 51, 30), count(url)
    assert wait_for(lambda: stat(url, "db_retries") >= 2, 10)
    assert stat(url, "duplicates") == 0
    postgres_server.drop_database(url)


@pytest.mark.allow_leaks  # the restarted PostgreSQL belongs to the session fixture again
def test_collector_started_while_the_database_is_down_waits_for_it(
        postgres_server: Any, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest) -> None:
    p, url = unique_prefix(request), postgres_server.create_database()
    config = CollectorConfig(broker_url=mqtt_broker.url, db_url=url, prefix=p, client_id=f"late-{p}",
                             db_retry_min_s=0.05, db_retry_max_s=0.5)
    collector = Collector(config)
    collectors.append(collector)
    postgres_server.stop()
    try:
        collector.start()  # returns at once: the writer thread waits for the store
        assert collector.state() == "waiting for database"
        assert wait_for(lambda: collector.stats().get("db_retries", 0) >= 2, 15)
        assert not collector.connected.is_set()  # no subscription before a store
        assert collector.state() == "waiting for database"
    finally:
        postgres_server.start()
    assert wait_for(collector.subscribed.is_set, 30)
    assert collector.state() == "collecting"
    publisher.send(f"{p}/dev-1/telemetry", sample(1))
    assert wait_for(lambda: count(url) == 1, 15)
    assert wait_for(lambda: stat(url, "db_retries") >= 2, 10)
    postgres_server.drop_database(url)


def _collect_cmd(broker: str, db: str, prefix: str, client_id: str) -> list[str]:
    # --retention-days 0: the retention check must never touch what this test counts (PostgreSQL), whatever
    # the samples' device clock.
    return [sys.executable, "-m", "deploy.cli", "collect", "--broker", broker, "--db", db, "--prefix", prefix,
            "--client-id", client_id, "--max-wait-s", "0.05", "--inflight", "50", "--batch-size", "20",
            "--retention-days", "0"]


def test_collector_killed_mid_stream_loses_nothing(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, request: pytest.FixtureRequest) -> None:
    p = unique_prefix(request)
    cmd = _collect_cmd(mqtt_broker.url, fleet_db_url, p, f"kill-{p}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_for(lambda: _subscribed(publisher, p, fleet_db_url), 30, interval=0.3)
        publisher.send_many([(f"{p}/dev-1/telemetry", sample(s)) for s in range(1, 2001)])
        assert wait_for(lambda: count(fleet_db_url) > 0, 15)
        proc.send_signal(signal.SIGKILL)  # mid-stream: some stored, some in a batch, some at the broker
        proc.wait(10)
        stored_at_kill = count(fleet_db_url)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert wait_for(lambda: count(fleet_db_url) == 2000, 60), count(fleet_db_url)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()
        assert json.loads(out.decode().strip().splitlines()[-1])["connected"] is not None
        assert stored_at_kill < 2000, "the kill came too late to test anything"
        assert query(fleet_db_url, "SELECT received FROM device_seq WHERE device_id = ?", ("dev-1",))[0]["received"] == 2000
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _subscribed(publisher: Publisher, prefix: str, url: str) -> bool:
    """Publish a probe event; true once one is stored (a message sent before the shared subscription
    exists goes nowhere, so the test must not start before it does)."""
    publisher.send(f"{prefix}/probe/events", {"seq": 1, "boot_id": BOOT, "ts": 1.0, "type": "probe"})
    try:
        return count(url, "events") > 0
    except Exception:  # noqa: BLE001 - the collector has not created the tables yet
        return False


def _notify_socket(directory: Path) -> socket.socket:
    """A stand-in for systemd's notify socket (a datagram socket the CLI sends READY/STATUS to)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(directory / "notify"))
    return sock


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_cli_is_ready_at_once_while_the_database_is_down_and_logs_no_password(
        mqtt_broker: Broker, request: pytest.FixtureRequest) -> None:
    """Type=notify: READY=1 comes before the store opens (before: only after it, so systemd killed a
    collector whose database was down at boot), STATUS= says what it waits for; the URL comes from the
    environment (not `ps`) and its password appears in no log line."""
    import tempfile

    p = unique_prefix(request)
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # AF_UNIX paths are limited to 108 bytes
        sock = _notify_socket(Path(short))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NOTIFY_SOCKET": str(Path(short) / "notify"),
               "EDGE_FLEET_DB": f"postgresql://fleet:hunter2@127.0.0.1:{_closed_port()}/fleet"}
        cmd = [sys.executable, "-m", "deploy.cli", "collect", "--broker", mqtt_broker.url, "--prefix", p,
               "--client-id", f"notify-{p}", "--log-level", "debug"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        try:
            ready, _, _ = select.select([sock], [], [], 60)
            assert ready, "no READY=1 while the database is down"
            message = sock.recv(4096).decode()
            assert "READY=1" in message and "STATUS=waiting for database" in message
            assert wait_for(lambda: any("fleet store unavailable" in line for line in lines), 30)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
            reader.join(10)
            sock.close()
    assert proc.returncode == 0, "".join(lines)
    logged = "".join(lines)
    assert "hunter2" not in logged + out and "://***@127.0.0.1" in logged
    assert json.loads(out.strip().splitlines()[-1])["connected"] is False


@pytest.mark.parametrize(("args", "why"), [
    (["--timescale", "on"], "timescale 'on' must be auto or off"),
    (["--log-level", "bogus"], "--log-level 'bogus' is not one of DEBUG, INFO, WARNING, ERROR"),
    (["--db", "mysql://fleet:hunter2@db/fleet"], "fleet store 'mysql://***@db/fleet'"),
])
def test_cli_names_the_bad_option_and_no_password(args: list[str], why: str) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    result = CliRunner().invoke(app, ["collect", "--broker", "mqtt://127.0.0.1:1", *args])
    assert result.exit_code == 2, (result.exception, result.output)
    assert why in result.stderr and "hunter2" not in result.output and "Traceback" not in result.output


def test_cli_takes_the_store_from_the_environment_or_a_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    runner, args = CliRunner(), ["collect", "--broker", "mqtt://127.0.0.1:1", "--timescale", "x"]
    url_file = tmp_path / "db.url"
    url_file.write_text("# the fleet store\nmysql://fleet:hunter2@db/fleet\n")
    for extra, env in (([], {"EDGE_FLEET_DB": "mysql://fleet:hunter2@db/fleet"}), (["--db-file", str(url_file)], {})):
        result = runner.invoke(app, [*args[:3], *extra], env=env)
        assert result.exit_code == 2 and "fleet store 'mysql://***@db/fleet'" in result.stderr, result.output
        assert "hunter2" not in result.output
    result = runner.invoke(app, [*args[:3], "--db-file", str(url_file), "--db", "sqlite:///x.db"])
    assert result.exit_code == 2 and "use one" in result.stderr
    result = runner.invoke(app, [*args[:3], "--db-file", str(tmp_path / "absent")])
    assert result.exit_code == 2 and "cannot read it" in result.stderr


def test_log_lines_and_tracebacks_have_passwords_masked() -> None:
    import io

    from deploy.fleet.redact import install_log_redaction, redact

    logger, stream = logging.getLogger("test.redact"), io.StringIO()
    logger.addHandler(logging.StreamHandler(stream))
    logger.propagate = False
    try:
        install_log_redaction(logger)
        logger.warning("store %s away", "postgresql://u:s3cret@h/db")
        try:
            raise RuntimeError("connect failed: host=h password='s3 cret' user=u")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.handlers.clear()
    assert "s3cret" not in stream.getvalue() and "s3 cret" not in stream.getvalue()
    assert "postgresql://***@h/db" in stream.getvalue() and "password=*** user=u" in stream.getvalue()
    assert redact("postgresql://u@h/db?password=x&sslmode=require") == "postgresql://***@h/db?password=***&sslmode=require"
    # Two URLs in one text: a URL without '@' before the next '://' may hold '://' in its password, so it is
    # hidden up to the next URL's '@' (over-hiding is accepted, showing a password is not).
    assert "x&" not in redact("mqtt://broker:1883 and postgresql://u@h/db?password=x&sslmode=require")
    # A password may hold '/', '#', '?' or '@': the user info is cut to the last '@' (agent.redact's rule).
    assert redact("postgresql://fleet:p/ss#w?rd@db:5432/fleet") == "postgresql://***@db:5432/fleet"


def test_cli_refuses_bad_options() -> None:
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "collect", "--broker", "mqtt://127.0.0.1:1",
                             "--db", "mysql://x", "--group", "a/b"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert "group 'a/b'" in result.stderr


def test_samples_stamped_in_the_future_are_clamped_counted_and_stored_once(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest) -> None:
    """A device clock a day ahead: the row's ts becomes the collector's receive time (the device's stays in
    the payload), counted as `future_ts`; a redelivery (a new receive time, and on PostgreSQL ts is in the
    unique key) is still stored once."""
    p = unique_prefix(request)
    start_collector(collectors, mqtt_broker.url, fleet_db_url, p)
    ahead = sample(1)
    ahead["ts"] = time.time() + 86400
    publisher.send_many([(f"{p}/dev-1/telemetry", ahead), (f"{p}/dev-1/telemetry", sample(2))])
    assert wait_for(lambda: count(fleet_db_url) == 2, 30)
    time.sleep(0.3)
    publisher.send_many([(f"{p}/dev-1/telemetry", ahead)])  # delivered again, received later
    assert wait_for(lambda: stat(fleet_db_url, "future_ts") == 2, 10)
    assert wait_for(lambda: stat(fleet_db_url, "duplicates") == 1, 10)
    assert count(fleet_db_url) == 2
    row = query(fleet_db_url, "SELECT ts, received, payload FROM telemetry WHERE seq = ?", (1,))[0]
    assert row["ts"] == pytest.approx(row["received"], abs=1.0) and json.loads(row["payload"])["ts"] == ahead["ts"]


def test_a_device_over_its_ingest_quota_is_cut_off_for_the_minute_and_counted(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest) -> None:
    """One device flooding (a hostile one sent 1 M events an hour) gets its quota a minute; the others all of
    theirs; status messages are never limited."""
    p = unique_prefix(request)
    start_collector(collectors, mqtt_broker.url, fleet_db_url, p, quota_msgs_per_min=50)
    now = int(time.time())
    if now % 60 > 50:  # keep the flood inside one minute
        time.sleep(61 - now % 60)
    flood = [(f"{p}/noisy/telemetry", sample(s, "noisy")) for s in range(1, 201)]
    calm = [(f"{p}/calm/telemetry", sample(s, "calm")) for s in range(1, 21)]
    publisher.send_many(flood + calm)
    assert wait_for(lambda: count(fleet_db_url) == 70, 30), count(fleet_db_url)
    rows = query(fleet_db_url, "SELECT device_id, COUNT(*) AS n FROM telemetry GROUP BY device_id")
    assert {r["device_id"]: r["n"] for r in rows} == {"noisy": 50, "calm": 20}
    assert wait_for(lambda: stat(fleet_db_url, "over_quota") == 150, 10)


def test_the_quota_counts_per_device_and_minute() -> None:
    from deploy.fleet.collector import DeviceQuota

    quota = DeviceQuota(msgs_per_min=2, bytes_per_min=100)
    t = 600.0
    assert [quota.over("e", "e/d1/telemetry", 10, t) for _ in range(4)] == [None, None, "d1", ""]
    assert quota.over("e", "e/d2/events", 10, t) is None  # another device
    assert quota.over("e", "e/d1/status", 10, t) is None  # retained status is never limited
    assert quota.over("e", "e/d1/telemetry", 10, t + 60) is None  # the next minute
    assert quota.over("e", "e/d3/telemetry", 101, t) == "d3"  # over in bytes
    assert DeviceQuota(0, 0).over("e", "e/d1/telemetry", 10**9, t) is None


def test_held_payload_bytes_stay_under_the_budget_while_the_store_is_slow(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory is bounded in bytes, not only in messages (3,000 held messages of up to 256 KiB reached 745 MB):
    with a slow store the collector stops reading at its byte budget and the broker keeps the rest."""
    import deploy.fleet.collector as collector_module

    real = collector_module.write_batch

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(collector_module, "write_batch", slow)
    p = unique_prefix(request)
    big = {"filler": "x" * 100_000}
    collector = start_collector(collectors, mqtt_broker.url, fleet_db_url, p, max_held_bytes=1_000_000, batch_size=5)
    publisher.send_many([(f"{p}/dev-1/telemetry", sample(s, **big)) for s in range(1, 61)])
    assert wait_for(lambda: count(fleet_db_url) == 60, 60), count(fleet_db_url)
    # the last batch is committed (counted above) a moment before its bytes are released
    assert wait_for(lambda: collector.stats()["held_bytes"] == 0, 10), collector.stats()
    stats = collector.stats()
    assert 0 < stats["held_bytes_high_water"] <= 1_000_000 + 110_000, stats  # the budget plus one message
    assert stat(fleet_db_url, "duplicates") == 0


def test_the_collector_names_stale_members_the_broker_api_reports(caplog) -> None:
    """Stands in for EMQX 5's management API (GET /api/v5/clients, Basic auth; the row fields as its "Clients
    API" documents them), served by a real HTTP server on loopback: a member that is gone without --leave is
    named at start with its queued messages; our own session and connected members are not."""
    import base64
    import http.server

    from deploy.fleet.broker_sessions import warn_stale_members

    asked: list[str] = []
    rows = [
        {"clientid": "edge-collector-g1-aaaa", "connected": False, "disconnected_at": "2026-12-01 10:00:00",
         "mqueue_len": 3999, "expiry_interval": 604800},
        {"clientid": "edge-collector-g1-self", "connected": False, "mqueue_len": 0},  # ours: not stale
        {"clientid": "edge-collector-g1-live", "connected": True, "mqueue_len": 0},
        {"clientid": "device-7", "connected": False},
    ]

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            asked.append(self.path)
            good = self.headers.get("Authorization") == "Basic " + base64.b64encode(b"key:secret").decode()
            body = json.dumps({"data": rows, "meta": {"count": len(rows), "page": 1, "limit": 1000}}).encode()
            self.send_response(200 if good else 401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body if good else b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with caplog.at_level(logging.WARNING, logger="deploy.fleet.broker_sessions"):
            stale = warn_stale_members(url, "g1", "edge-collector-g1-self", ("key", "secret"))
            refused = warn_stale_members(url, "g1", "edge-collector-g1-self", ("key", "wrong"))
    finally:
        server.shutdown()
    assert [m.client_id for m in stale] == ["edge-collector-g1-aaaa"] and stale[0].queued == 3999
    assert "edge-collector-g1-aaaa" in caplog.text and "3999 messages queued" in caplog.text
    assert "--leave --client-id edge-collector-g1-aaaa" in caplog.text
    assert refused == [] and "could not ask the broker API" in caplog.text  # a refusal is a warning, not a stop
    assert "conn_state=disconnected" in asked[0] and "like_clientid=edge-collector-" in asked[0]
    assert warn_stale_members(None, "g1", "x", None) == []  # Mosquitto: no API, nothing to ask


def test_two_collectors_with_one_client_id_are_told_apart_by_an_error(
        fleet_db_url: str, mqtt_broker: Broker, collectors: list, request: pytest.FixtureRequest, caplog) -> None:
    """Two instances given the same id took the session from each other every second with only a warning
    (Mosquitto closes the first one's socket without a reason code): now an error names the likely cause."""
    p = unique_prefix(request)
    with caplog.at_level(logging.ERROR, logger="deploy.fleet.collector"):
        start_collector(collectors, mqtt_broker.url, fleet_db_url, p, client_id=f"{p}-same")
        start_collector(collectors, mqtt_broker.url, fleet_db_url, p, client_id=f"{p}-same")
        assert wait_for(lambda: "another collector probably uses the same client id" in caplog.text, 60)
    assert f"{p}-same" in caplog.text


def test_a_broker_that_says_session_taken_over_stops_the_second_holder() -> None:
    """MQTT 5 reason 142 (EMQX and HiveMQ send it): twice within a minute, the collector stops and names the id."""
    from types import SimpleNamespace

    collector = Collector(CollectorConfig(broker_url="mqtt://127.0.0.1:1", db_url="sqlite:///x.db", client_id="dup"))
    taken = SimpleNamespace(value=142)
    collector._on_disconnect(None, None, None, taken, None)
    assert collector.fatal is None
    collector._on_disconnect(None, None, None, taken, None)
    assert collector.fatal is not None and "'dup'" in collector.fatal and collector.stop_event.is_set()
