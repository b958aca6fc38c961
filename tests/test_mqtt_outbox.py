"""SQLite outbox: stamping, persistence of seq and drop counters, caps (telemetry first), threads."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest

from agent.mqtt.outbox import Outbox, read_boot_id, to_json_bytes
from agent.storage.schema import ensure_outbox as ensure_schema
from agent.mqtt.publisher import mark_replayed


@pytest.fixture
def boot_root(tmp_path: Path) -> Path:
    path = tmp_path / "root" / "proc/sys/kernel/random/boot_id"
    path.parent.mkdir(parents=True)
    path.write_text("4a1e0c52-8d2f-4a3b-9c1e-0f5b7e6d1a23\n")
    return tmp_path / "root"


def _payloads(box: Outbox) -> list[dict]:
    return [json.loads(row.payload) for row in box.fetch(0, limit=10_000)]


def test_stamps_seq_boot_id_ts(tmp_path: Path, boot_root: Path) -> None:
    box = Outbox(tmp_path / "s.db", root=boot_root)
    assert box.enqueue("telemetry", "edge/d/telemetry", {"fps": 20.5}) == 1
    assert box.enqueue("event", "edge/d/events", {"type": "swap", "ts": 123.0}) == 2
    first, second = _payloads(box)
    assert first["seq"] == 1 and first["boot_id"] == "4a1e0c52-8d2f-4a3b-9c1e-0f5b7e6d1a23" and first["fps"] == 20.5
    assert isinstance(first["ts"], float) and second["ts"] == 123.0 and second["type"] == "swap"
    with pytest.raises(ValueError, match="stamped by the outbox"):
        box.enqueue("telemetry", "t", {"seq": 5})
    box.close()


def test_seq_and_rows_survive_reopen(tmp_path: Path, boot_root: Path) -> None:
    box = Outbox(tmp_path / "s.db", root=boot_root)
    box.enqueue_many("telemetry", "t", [{"i": i} for i in range(3)])
    box.close()
    again = Outbox(tmp_path / "s.db", boot_id="next-boot")
    assert len(again) == 3 and again.enqueue("telemetry", "t", {"i": 3}) == 4
    assert _payloads(again)[-1]["boot_id"] == "next-boot"
    again.close()


def test_a_store_stamps_its_epoch_and_a_recreated_store_gets_another(tmp_path: Path, boot_root: Path) -> None:
    """The epoch tells the collector that a store recreated under the same boot (its seq back at 1) is a new
    stream, not duplicates to drop (issue 19); it survives reopening, and a store from before epochs sends none."""
    box = Outbox(tmp_path / "s.db", root=boot_root)
    box.enqueue("telemetry", "t", {"fps": 1.0})
    epoch = _payloads(box)[0]["epoch"]
    assert isinstance(epoch, int) and epoch > 0
    box.close()
    box = Outbox(tmp_path / "s.db", root=boot_root)
    box.enqueue("telemetry", "t", {"fps": 2.0})
    assert [p["epoch"] for p in _payloads(box)] == [epoch, epoch] and box.epoch == epoch
    box.close()
    (tmp_path / "s.db").rename(tmp_path / "s.db.corrupt")  # what the state store's quarantine does
    fresh = Outbox(tmp_path / "s.db", root=boot_root)
    fresh.enqueue("telemetry", "t", {"fps": 3.0})
    (first,) = _payloads(fresh)
    assert first["seq"] == 1 and first["epoch"] not in (0, epoch) and first["boot_id"] == _payloads_boot(boot_root)
    with pytest.raises(ValueError, match="stamped by the outbox"):
        fresh.enqueue("telemetry", "t", {"epoch": 5})
    fresh.close()
    legacy = sqlite3.connect(tmp_path / "legacy.db")  # numbered messages before epochs existed
    ensure_schema(legacy)
    legacy.execute("INSERT INTO mqtt_counters (name, value) VALUES ('seq', 41)")
    legacy.commit()
    legacy.close()
    old = Outbox(tmp_path / "legacy.db", root=boot_root)
    old.enqueue("telemetry", "t", {"fps": 4.0})
    (row,) = _payloads(old)
    assert row["seq"] == 42 and "epoch" not in row and old.epoch == 0
    old.close()


def _payloads_boot(root: Path) -> str:
    return (root / "proc/sys/kernel/random/boot_id").read_text().strip()


def test_missing_boot_id_falls_back_to_random(tmp_path: Path) -> None:
    first, second = read_boot_id(tmp_path), read_boot_id(tmp_path)
    assert len(first) == 36 and first != second


def test_row_cap_drops_oldest_telemetry_first(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "s.db", max_rows=10, boot_id="b")
    box.enqueue("event", "e", {"type": "first"})
    box.enqueue_many("telemetry", "t", [{"i": i} for i in range(9)])
    box.enqueue("event", "e", {"type": "second"})
    box.enqueue_many("telemetry", "t", [{"i": i} for i in range(9, 12)])
    kept = _payloads(box)
    assert len(kept) == 10 and len(box) == 10
    assert [p.get("type") for p in kept if "type" in p] == ["first", "second"]
    assert [p["i"] for p in kept if "i" in p] == list(range(4, 12))
    assert box.stats()["dropped_telemetry"] == 4 and box.stats()["dropped_event"] == 0
    box.close()


def test_events_dropped_last_and_counters_persist(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "s.db", max_rows=10, boot_id="b")
    box.enqueue_many("event", "e", [{"type": "x", "n": n} for n in range(13)])
    assert [p["n"] for p in _payloads(box)] == list(range(3, 13))
    box.close()
    again = Outbox(tmp_path / "s.db", max_rows=10, boot_id="b")
    assert again.stats()["dropped_event"] == 3
    again.close()


def test_byte_cap(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "s.db", max_rows=10_000, max_bytes=64 * 1024, boot_id="b")
    box.enqueue("event", "e", {"type": "keep", "blob": "y" * 1000})
    box.enqueue_many("telemetry", "t", [{"blob": "x" * 1000, "i": i} for i in range(100)])
    stats = box.stats()
    assert stats["bytes"] <= 64 * 1024 and stats["dropped_telemetry"] > 30
    kept = _payloads(box)
    assert kept[0]["type"] == "keep" and kept[-1]["i"] == 99
    on_disk = sqlite3.connect(tmp_path / "s.db").execute("SELECT SUM(LENGTH(payload)) FROM mqtt_outbox").fetchone()[0]
    assert on_disk == stats["bytes"]
    box.close()


def test_fetch_ranges_and_delete(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "s.db", boot_id="b")
    box.enqueue_many("telemetry", "t", [{"i": i} for i in range(10)])
    assert [r.id for r in box.fetch(3, 6)] == [4, 5, 6] and box.max_id() == 10
    assert box.delete([1, 2, 99]) == 2 and len(box) == 8
    assert box.stats()["bytes"] == sum(len(r.payload) for r in box.fetch(0))
    box.close()


def test_concurrent_enqueue_unique_seq(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "s.db", boot_id="b")
    seqs: list[int] = []
    lock = threading.Lock()

    def produce() -> None:
        for i in range(200):
            seq = box.enqueue("telemetry", "t", {"i": i})
            with lock:
                seqs.append(seq)

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seqs) == list(range(1, 801))
    assert [p["seq"] for p in _payloads(box)] == list(range(1, 801))  # id order is seq order
    box.close()


def test_ensure_schema_is_idempotent(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "s.db")
    ensure_schema(conn)
    ensure_schema(conn)
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"mqtt_outbox", "mqtt_counters"} <= names


def test_json_encoding_leaves_out_non_finite() -> None:
    assert json.loads(to_json_bytes({"a": float("nan"), "b": {"c": float("inf"), "d": 1}})) == {"b": {"d": 1}}
    assert json.loads(mark_replayed(b'{"seq":1}')) == {"seq": 1, "replayed": True}
