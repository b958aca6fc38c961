"""The fleet collector's stream, against a real Mosquitto, real SQLite files and a real PostgreSQL server.

Exactly once per (device_id, boot_id, seq): duplicates and replays stored once, gaps counted as lost on
the device; two collectors splitting one stream; a collector killed with SIGKILL mid-stream losing
nothing; broker and database outages; malformed device messages counted and dropped, never fatal; the
ingest policy (device clocks clamped, per-device quotas) and memory bounded in messages and bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from deploy.fleet.collector import Collector, CollectorConfig
from deploy.fleet.inbox import Inbound
from deploy.fleet.store_writer import BatchStore
from tests.fixtures_mqtt import Broker
from tests.fleet_collector_helpers import (BOOT, ROOT, Publisher, count, publisher_on, query, sample, start_collector,
                                           stat, stopped_at_end, unique_prefix)
from tests.helpers import wait_for


@pytest.fixture
def publisher(mqtt_broker: Broker) -> Iterator[Publisher]:
    yield from publisher_on(mqtt_broker)


@pytest.fixture
def collectors() -> Iterator[list[Collector]]:
    """Collectors made in a test are stopped at its end."""
    yield from stopped_at_end()


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
    assert (
        query(fleet_db_url, "SELECT type FROM events WHERE device_id = ?", ("dev-2",))[0]["type"] == "lone ? surrogate"
    )
    assert collector.stats()["malformed"] == 8 and collector.writer.is_alive()


def test_a_message_the_parser_fails_on_is_dropped_and_acknowledged(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Any exception of the parser (a bug, not only `Malformed`) costs one message, never the stream."""
    import deploy.fleet.ingest as ingest_module

    real = ingest_module.parse_message

    def parser_with_a_bug(prefix: str, topic: str, payload: bytes, *args: Any) -> Any:
        if b"boom" in payload:
            raise KeyError("a parser bug")
        return real(prefix, topic, payload, *args)

    monkeypatch.setattr(ingest_module, "parse_message", parser_with_a_bug)
    p = unique_prefix(request)
    collector = start_collector(collectors, mqtt_broker.url, fleet_db_url, p, max_wait_s=0.05)
    topic = f"{p}/dev-1/telemetry"
    publisher.send_many([(topic, sample(1, note="boom")), (topic, sample(2))])
    assert wait_for(lambda: count(fleet_db_url) == 1, 15)
    assert wait_for(lambda: stat(fleet_db_url, "malformed") == 1, 10)
    assert collector.writer.is_alive() and "parser failed on" in caplog.text


def test_a_failing_batch_never_kills_the_writer(
        fleet_db_url: str, mqtt_broker: Broker, publisher: Publisher, collectors: list,
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector's first unit of work fails with an error nobody foresaw: that batch is counted and not
    acknowledged, and the writer thread goes on with the next."""
    p = unique_prefix(request)
    config = CollectorConfig(broker_url=mqtt_broker.url, db_url=fleet_db_url, prefix=p, client_id=f"once-{p}",
                             max_wait_s=0.05, db_retry_min_s=0.05, db_retry_max_s=0.1)
    collector = Collector(config)
    real, failed = collector.writer.process, []

    def failing_once(batch: list[Inbound], store: BatchStore) -> bool:
        if batch and not failed:
            failed.append(batch)
            raise RuntimeError("unforeseen")
        return real(batch, store)

    monkeypatch.setattr(collector.writer, "process", failing_once)
    collectors.append(collector)
    collector.start()
    assert wait_for(collector.subscribed.is_set, 10)
    publisher.send(f"{p}/dev-1/telemetry", sample(1))  # the failing batch: not stored, not acknowledged
    assert wait_for(lambda: collector.stats().get("writer_errors") == 1, 10)
    publisher.send(f"{p}/dev-1/telemetry", sample(2))
    assert wait_for(lambda: count(fleet_db_url) == 1, 15)
    assert collector.writer.is_alive() and collector.stats()["unstored"] == 1
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
        assert (
            query(fleet_db_url, "SELECT received FROM device_seq WHERE device_id = ?", ("dev-1",))[0]["received"]
            == 2000
        )
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
    from deploy.fleet.ingest import DeviceQuota

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
    import deploy.fleet.store_writer as store_writer_module

    real = store_writer_module.write_batch

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(store_writer_module, "write_batch", slow)
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
