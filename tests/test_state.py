"""State store: real SQLite files, WAL, migrations, and what survives a reopen."""

from __future__ import annotations

import gc
import sqlite3
import threading
from pathlib import Path

import pytest

from agent.storage.state import MIGRATIONS, StateStore, StateStoreError


def test_fresh_database_is_migrated_in_wal_mode(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    assert store.schema_version == len(MIGRATIONS)
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_migrations_run_once_and_in_order(tmp_path: Path) -> None:
    calls: list[int] = []
    store = StateStore(tmp_path / "state.db")
    extra = [*MIGRATIONS, lambda db: calls.append(1) or db.execute("CREATE TABLE extra (x)")]
    store.migrate(extra)
    store.migrate(extra)
    assert calls == [1] and store.schema_version == len(extra)
    store.close()


def test_failed_migration_rolls_back(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")

    def broken(db):
        db.execute("CREATE TABLE half (x)")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        store.migrate([*MIGRATIONS, broken])
    assert store.schema_version == len(MIGRATIONS)
    assert not store.query("SELECT name FROM sqlite_master WHERE name = 'half'")
    store.close()


def test_newer_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    StateStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(StateStoreError, match="newer than this agent"):
        StateStore(path)


def test_runs_models_events_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    run_id = store.start_run(123)
    store.set_active_model("a", "1", "/models/a", "aa" * 32, {"backend": "onnxruntime"})
    store.set_active_model("b", "2", "/models/b", "bb" * 32, {"backend": "onnxruntime"})
    store.add_event("swap", {"from": "a", "to": "b"})
    store.finish_run(run_id, {"frames": 5, "model": {"name": "b", "version": "2"}})
    store.set_kv("seq", 41)
    store.close()

    store = StateStore(path)
    assert store.model_slot("active")["name"] == "b"
    assert store.model_slot("previous")["name"] == "a"
    assert store.events(1)[0]["payload"] == {"from": "a", "to": "b"}
    assert store.last_run()["summary"]["frames"] == 5 and store.last_run()["model"] == "b@2"
    assert store.get_kv("seq") == 41
    store.close()


def test_reactivating_the_same_model_keeps_previous(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    store.set_active_model("a", "1", "/a", "aa" * 32, {})
    store.set_active_model("b", "1", "/b", "bb" * 32, {})
    store.set_active_model("b", "1", "/b", "bb" * 32, {})  # a restart re-records the same model
    assert store.model_slot("previous")["name"] == "a"
    store.close()


def test_unclean_previous_run_is_marked_crashed(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    first = store.start_run(1)
    store.start_run(2)
    assert store.query("SELECT status FROM runs WHERE id = ?", (first,))[0]["status"] == "crashed"
    store.close()


def test_begin_that_cannot_get_the_write_lock_leaves_the_store_usable(tmp_path: Path) -> None:
    """Issue 12 item 1: a failed BEGIN IMMEDIATE used to keep the store's lock and depth forever."""
    path = tmp_path / "state.db"
    store = StateStore(path, busy_timeout_s=0.05)  # the production 10 s, made short
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        store.add_event("lost", {})
    holder.execute("ROLLBACK")
    holder.close()

    done = threading.Event()
    reader = threading.Thread(target=lambda: (store.events(1), done.set()), name="reader", daemon=True)
    reader.start()
    assert done.wait(10), "a plain read in another thread is still blocked after the lock is gone"
    reader.join(10)
    with pytest.raises(RuntimeError):  # later transactions still BEGIN and ROLL BACK
        with store.transaction() as db:
            db.execute("INSERT INTO kv (key, value) VALUES ('half', '1')")
            raise RuntimeError("boom")
    assert store.get_kv("half") is None and not store.db.conn.in_transaction
    store.add_event("kept", {})
    assert store.events(1)[0]["type"] == "kept"
    store.close()


def test_a_close_whose_checkpoint_cannot_run_still_closes_and_keeps_the_rows(tmp_path: Path, caplog) -> None:
    """Issue 47: SIGTERM on a full disk ended in a traceback from the checkpoint at close. A checkpoint that cannot
    run (here: a statement still reading on the same connection, SQLite's "database table is locked") is logged;
    the connection closes and the rows stay in the WAL for the next open."""
    path = tmp_path / "state.db"
    store = StateStore(path, busy_timeout_s=0.05)  # the checkpoint waits the busy timeout before it gives up
    for i in range(50):
        store.add_event("tick", {"i": i})
    reading = store.db.conn.execute("SELECT * FROM events")
    reading.fetchone()
    store.close()
    assert "WAL not checkpointed at close" in caplog.text
    with pytest.raises(sqlite3.ProgrammingError):
        store.db.conn.execute("SELECT 1")
    del reading  # SQLite closes a connection for good once its last statement is finalized
    gc.collect()
    again = StateStore(path)
    assert len(again.events(100)) == 50
    again.close()


def test_a_quick_write_waits_briefly_for_a_lock_and_the_usual_wait_comes_back(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path, busy_timeout_s=3.0)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            store.quick(lambda: store.set_kv("a", 1), 0.05)()
        assert store.db.execute("PRAGMA busy_timeout").fetchone()[0] == 3000
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    store.quick(lambda: store.set_kv("a", 1))()
    assert store.get_kv("a") == 1
    store.close()
