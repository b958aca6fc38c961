"""Writes that wait for the state store, the WAL read at start, and events that reach the broker when the outbox
cannot be written (issue 47), with real SQLite locks and a real Mosquitto.

The lock is another connection's `BEGIN IMMEDIATE`; a full disk is SQLite's own SQLITE_FULL from `PRAGMA
max_page_count` (what a full filesystem gives it); busy timeouts are short through parameters.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

import agent.storage.health as sh
from agent.mqtt.config import MqttConfig
from agent.mqtt.plane import MqttPlane
from agent.storage.state import StateStore
from agent.storage.health import StorageHealth
from agent.storage.reclaim import serving_paths
from tests.helpers import WriteLock, wait_for


@pytest.fixture
def lock() -> Iterator[Any]:
    """`hold(path)` takes the write lock from another connection until `release()`."""
    held = WriteLock('IMMEDIATE')
    yield held
    held.release()


def test_writes_kept_while_the_store_is_locked_land_in_order_once_it_goes(tmp_path: Path, lock, monkeypatch,
                                                                          caplog) -> None:
    backoff = sh.Backoff
    monkeypatch.setattr(sh, "Backoff", lambda: backoff(0.05, 0.2))
    caplog.set_level(logging.INFO, logger="agent.storage.health")
    store = StateStore(tmp_path / "state.db", busy_timeout_s=0.05)
    events: list[tuple[str, dict]] = []
    health = StorageHealth(lambda kind, **f: events.append((kind, f)))
    try:
        lock.hold(tmp_path / "state.db")
        assert not health.defer("run record", store.quick(lambda: store.set_kv("a", 1), 0.05))
        assert not health.defer("event x", store.quick(lambda: store.add_event("x", {}), 0.05), event=True)
        assert not health.defer("active model", store.quick(lambda: store.set_kv("b", 2), 0.05))
        status = health.status()
        assert health.degraded and status["waiting"] == "run record, active model, 1 event(s)", status
        assert [kind for kind, _ in events] == ["storage_degraded"] and events[0][1]["write"] == "run record"
        assert wait_for(lambda: health.failures >= 3, timeout=30)  # tried again in the background, still locked
        assert store.get_kv("a") is None
        lock.release()
        assert wait_for(lambda: not health.degraded, timeout=30), health.status()
        assert store.get_kv("a") == 1 and store.get_kv("b") == 2 and [e["type"] for e in store.events()] == ["x"]
        assert [kind for kind, _ in events] == ["storage_degraded", "storage_recovered"]
        assert health.status()["waiting"] is None
        assert "waiting; next try in" in caplog.text
    finally:
        health.close()
        store.close()


def test_waiting_events_are_bounded_and_what_stays_unrecorded_at_stop_is_named(tmp_path: Path, lock, monkeypatch,
                                                                             caplog) -> None:
    monkeypatch.setattr(sh, "MAX_WAITING_EVENTS", 3)
    store = StateStore(tmp_path / "state.db", busy_timeout_s=0.05)
    health = StorageHealth(lambda kind, **f: None)
    try:
        lock.hold(tmp_path / "state.db")
        health.defer("run record", store.quick(lambda: store.set_kv("a", 1), 0.05))
        for i in range(5):
            health.defer(f"event {i}", store.quick(lambda: store.add_event("e", {}), 0.05), event=True)
        assert health.unrecorded_events == 2 and health.status()["waiting"] == "run record, 3 event(s)"
        with caplog.at_level(logging.ERROR):
            health.close(flush=True)  # the stop: one last try, then the log names what is lost
        assert "run record, 3 event(s) not recorded before the agent stopped" in caplog.text
    finally:
        health.close(flush=False)
        store.close()


def test_a_full_disk_reports_storage_full_once_with_the_bytes_free(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    events: list[tuple[str, dict]] = []
    health = StorageHealth(lambda kind, **f: events.append((kind, f)), free_bytes=lambda: 4096)
    try:
        pages = store.db.execute("PRAGMA page_count").fetchone()[0]
        store.db.execute(f"PRAGMA max_page_count = {pages}")  # full: SQLite says SQLITE_FULL
        for _ in range(3):
            with health.guard("live status"):
                store.set_kv("big", "x" * 100_000)
        full = [f for kind, f in events if kind == "storage_full"]
        assert full == [{"code": "STORAGE_FULL", "free_bytes": 4096}]
        assert health.status()["full"]["free_bytes"] == 4096
        store.db.execute("PRAGMA max_page_count = 1073741823")
        with health.guard("live status"):
            store.set_kv("big", "x" * 100_000)
        assert health.status()["full"] is None and events[-1][0] == "storage_recovered"
    finally:
        health.close()
        store.close()


def test_serving_models_are_read_through_the_wal(tmp_path: Path) -> None:
    """Killed with its last writes in the WAL, state.db alone says nothing of the active model (the old
    `immutable` read failed with `no such table`, so no unused artifact could be shed on a full disk)."""
    db = tmp_path / "state.db"
    writer = StateStore(db)
    writer.set_active_model("m", "1", str(tmp_path / "a" / "serving"), "ab" * 32, {})
    writer.set_active_model("m", "2", str(tmp_path / "a" / "newer"), "cd" * 32, {})
    try:  # the writer stays open, as a killed agent left it: nothing checkpointed yet
        assert Path(f"{db}-wal").stat().st_size > 0
        immutable = sqlite3.connect(f"{db.as_uri()}?mode=ro&immutable=1", uri=True)
        with pytest.raises(sqlite3.Error):
            immutable.execute("SELECT path FROM active_model").fetchall()
        immutable.close()
        assert serving_paths(db) == {tmp_path / "a" / "serving", tmp_path / "a" / "newer"}
    finally:
        writer.db.conn.close()


# --- the outbox cannot be written: events still reach the broker ------------------------------------------

@pytest.fixture
def plane(tmp_path: Path, mqtt_broker) -> Iterator[MqttPlane]:
    made = MqttPlane(MqttConfig(url=mqtt_broker.url, reconnect_min_s=0.1, reconnect_max_s=0.5),
                     device_id="unstored", db_path=tmp_path / "state.db", agent_version="test")
    made.start()
    assert wait_for(lambda: made.connected, 10)
    yield made
    made.stop(timeout=5, flush_s=0)


def test_storage_events_reach_the_broker_while_the_outbox_cannot_be_written(tmp_path: Path, mqtt_broker, plane, lock,
                                                                            collector_factory) -> None:
    collector = collector_factory(mqtt_broker.url, ["edge/unstored/events"])
    store = StateStore(tmp_path / "state.db", busy_timeout_s=0.05)
    health = StorageHealth(plane.enqueue_event)  # what the agent's emit does: store it, then on to MQTT
    try:
        lock.hold(tmp_path / "state.db")  # the outbox lives in the same file: it is locked too
        with health.guard("live status"):
            store.set_kv("live", 1)
        lock.release()
        pages = plane.outbox._conn.execute("PRAGMA page_count").fetchone()[0]
        plane.outbox._conn.execute(f"PRAGMA max_page_count = {pages}")  # now the outbox's disk is full
        plane.enqueue_event("filler", pad="x" * 50_000)  # fails: SQLITE_FULL; it goes to memory too
        store.db.execute(f"PRAGMA max_page_count = {store.db.execute('PRAGMA page_count').fetchone()[0]}")
        with health.guard("run summary"):
            store.set_kv("big", "x" * 100_000)  # a full disk under the store as well: STORAGE_FULL
        kinds = {"storage_degraded", "filler", "storage_full"}
        assert collector.wait_for(lambda msgs: kinds <= {json.loads(p)["type"] for _, p, _ in msgs}, timeout=30), \
            collector.messages
        by_type = {body["type"]: body for body in collector.payloads("edge/unstored/events")}
        degraded = by_type["storage_degraded"]  # the exception's name stays in the device log (issue 47: wire texts)
        assert degraded["code"] == "STORAGE_DEGRADED" and "ref" in degraded["error"] and degraded["volatile"]
        assert by_type["storage_full"]["code"] == "STORAGE_FULL" and by_type["storage_full"]["volatile"] is True
        memory = [body for body in by_type.values() if body.get("volatile")]
        assert len({body["epoch"] for body in memory}) == 1 and memory[0]["epoch"] != plane.outbox.epoch
        stats = plane.publisher.stats()
        assert stats["events_held_in_memory"] >= 3 and stats["outbox_write_errors"] >= 1, stats
        assert wait_for(lambda: plane.publisher.stats().get("events_sent_from_memory", 0) >= 3, timeout=30), stats
        assert plane.enqueue_telemetry({"fps": 1.0, "pad": "x" * 50_000}) == 0
        assert plane.publisher.stats()["telemetry_unstored"] >= 1
    finally:
        health.close()
        store.close()


def test_events_held_in_memory_are_bounded_and_counted_while_the_broker_is_down(tmp_path: Path, broker_factory,
                                                                                lock) -> None:
    broker = broker_factory()
    made = MqttPlane(MqttConfig(url=broker.url, reconnect_min_s=0.1, reconnect_max_s=0.5), device_id="offline",
                     db_path=tmp_path / "state.db", agent_version="test")
    made.start()
    try:
        assert wait_for(lambda: made.connected, 10)
        broker.stop()
        assert wait_for(lambda: not made.connected, 10)
        lock.hold(tmp_path / "state.db")
        seqs = [made.enqueue_event("tick", i=i) for i in range(300)]
        from agent.mqtt.outbox import MEMORY_EVENTS

        stats = made.publisher.stats()
        assert seqs == list(range(1, 301)) and stats["events_in_memory"] == MEMORY_EVENTS, stats  # the memory's seq
        assert stats["events_dropped_from_memory"] == 300 - MEMORY_EVENTS, stats  # the oldest: a seq gap to see
        broker.start()
        assert wait_for(lambda: made.publisher.stats().get("events_sent_from_memory", 0) == MEMORY_EVENTS,
                        timeout=60), made.publisher.stats()
        assert made.publisher.stats().get("events_in_memory", 0) == 0
    finally:
        lock.release()
        made.stop(timeout=5, flush_s=0)


def test_the_outbox_takes_events_again_once_it_can(tmp_path: Path, plane, lock, monkeypatch) -> None:
    import agent.mqtt.publisher as publisher

    monkeypatch.setattr(publisher, "OUTBOX_RETRY_MIN_S", 0.01)
    plane.publisher._outbox_backoff = 0.01
    plane.outbox._conn.execute("PRAGMA busy_timeout=50")
    lock.hold(tmp_path / "state.db")
    plane.enqueue_event("while_locked")
    assert plane.publisher.stats()["events_held_in_memory"] == 1
    lock.release()
    rows_before = plane.outbox.stats()["seq"]
    assert wait_for(lambda: plane.enqueue_event("after") > rows_before and plane.outbox.stats()["seq"] > rows_before,
                    timeout=10)
    assert plane.publisher._outbox_retry_at is None


def test_two_flushes_at_once_never_make_a_write_twice() -> None:
    """The retry thread and a stop may both flush: a write is never made twice."""
    made: list[int] = []
    health = StorageHealth(lambda kind, **f: None)
    gate = threading.Event()

    def slow_write() -> None:
        gate.wait(5)
        made.append(1)

    health._waiting.append(sh._Write("slow", slow_write, False))
    flusher = threading.Thread(target=health.flush)
    flusher.start()
    second = threading.Thread(target=health.flush)
    second.start()
    gate.set()
    flusher.join(10)
    second.join(10)
    assert made == [1]
    health.close()
