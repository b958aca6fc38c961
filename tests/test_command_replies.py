"""Issue 47 item 2, piece by piece with real SQLite: a reply never waits on the disk.

The write lock is held by a second real sqlite3 connection (`BEGIN EXCLUSIVE`) on the dispatcher's database, with
the production busy timeout (5 s): a reply that waited for its disk copy would take 5 s. The end-to-end version
with a real agent process and a real broker is tests/test_command_lock.py.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent.control.commands import CommandDispatcher
from agent.control.reply_store import ReplyStore
from agent.daemon.control import BoundedRead, ConfigWriter
from tests.fixtures_mqtt import FakeControl
from tests.helpers import WriteLock, wait_for

FAST_S = 1.0  # the bound on a reply while the database is locked


@pytest.fixture
def lock() -> Iterator[Any]:
    held = WriteLock('EXCLUSIVE')
    yield held
    held.release()


def _send(dispatcher: CommandDispatcher, command: str, cid: str, args: dict | None = None) -> tuple[float, dict]:
    started = time.monotonic()
    reply = dispatcher.dispatch(json.dumps({"id": cid, "command": command, "args": args or {}}).encode())
    return time.monotonic() - started, reply


def test_replies_are_sent_first_and_remembered_behind_a_locked_database(tmp_path: Path, lock) -> None:
    db = tmp_path / "state.db"
    control = FakeControl()
    dispatcher = CommandDispatcher(control, db)  # the production busy timeout: 5 s
    try:
        lock.hold(db)
        took = [_send(dispatcher, name, f"c{i}") for i, name in enumerate(["ping", "status", "set_config"] * 3)
                if name != "set_config"] + [_send(dispatcher, "set_config", "cfg", {"log_level": "INFO"})]
        assert all(seconds < FAST_S and reply["ok"] for seconds, reply in took), took
        again_s, again = _send(dispatcher, "status", "c1")  # a repeated id while its disk copy is pending
        assert again_s < FAST_S and again == took[1][1] and [c for c, _ in control.calls].count("status") == 3
        assert wait_for(lambda: dispatcher.stats()["replies_not_remembered"] >= 1, 10), dispatcher.stats()
        stats = dispatcher.stats()
        assert stats["replies_pending"] == len(took) and stats["replies_remembered"] == 0, stats
        lock.release()
        assert wait_for(lambda: dispatcher.stats()["replies_pending"] == 0, 15), dispatcher.stats()
        assert dispatcher.stats()["replies_remembered"] == len(took) and dispatcher.stats()["replies_lost"] == 0
    finally:
        dispatcher.close()
    store = ReplyStore(db)
    try:
        assert store.get("c1") == took[1][1]  # on disk now: a restart still knows the id
    finally:
        store.close()


def test_replies_still_pending_at_close_are_counted_lost(tmp_path: Path, lock) -> None:
    db = tmp_path / "state.db"
    dispatcher = CommandDispatcher(FakeControl(), db, busy_timeout_s=0.05)
    lock.hold(db)
    assert _send(dispatcher, "ping", "p1")[1]["ok"]
    assert wait_for(lambda: dispatcher.stats()["replies_not_remembered"] == 1, 10)
    dispatcher.close()
    assert dispatcher.stats()["replies_lost"] == 1


class DiskBoundControl(FakeControl):
    """A daemon whose rollback writes the state database, as the real one does."""

    def __init__(self, db: Path) -> None:
        super().__init__()
        self.db = db

    def rollback(self) -> dict:
        conn = sqlite3.connect(str(self.db), timeout=10.0, isolation_level=None)
        try:
            conn.execute("CREATE TABLE IF NOT EXISTS marks (ts REAL)")
            conn.execute("INSERT INTO marks VALUES (?)", (time.time(),))
        finally:
            conn.close()
        return super().rollback()


def test_a_handler_stuck_on_the_locked_database_is_answered_busy_and_its_reply_kept(tmp_path: Path, lock) -> None:
    db = tmp_path / "state.db"
    control = DiskBoundControl(db)
    dispatcher = CommandDispatcher(control, db)
    try:
        lock.hold(db)
        took, busy = _send(dispatcher, "rollback", "rb-1")
        assert took < FAST_S and busy["error"]["code"] == "BUSY", (took, busy)
        assert "ask again with the same id" in busy["error"]["message"]
        took, ping = _send(dispatcher, "ping", "p-1")  # nothing waits behind it
        assert took < FAST_S and ping["ok"]
        took, still = _send(dispatcher, "rollback", "rb-1")
        assert took < FAST_S and still["error"]["code"] == "BUSY" and "still running" in still["error"]["message"]
        lock.release()
        assert wait_for(lambda: _send(dispatcher, "rollback", "rb-1")[1]["ok"], 15)
        assert [c for c, _ in control.calls].count("rollback") == 1  # ran once; the same id got its reply
    finally:
        dispatcher.close()


def test_handlers_left_running_are_bounded(tmp_path: Path) -> None:
    release = threading.Event()
    control = FakeControl()
    control.restart_pipeline = lambda camera=None: (release.wait(10), {"restarted": True})[1]
    dispatcher = CommandDispatcher(control, tmp_path / "state.db", max_running=2, storage_check_s=0.05)
    dispatcher.replies.store.write_locked = lambda: True
    try:
        first = [_send(dispatcher, "restart_pipeline", f"r{i}")[1]["error"] for i in range(2)]
        refused = _send(dispatcher, "restart_pipeline", "r2")[1]["error"]
        assert [e["code"] for e in first] == ["BUSY", "BUSY"] and "still running" in first[0]["message"]
        assert refused["code"] == "BUSY" and "was not run" in refused["message"]
        assert dispatcher.stats()["running"] == 2 and dispatcher.stats()["refused_running"] == 1
    finally:
        release.set()
        assert wait_for(lambda: dispatcher.stats()["running"] == 0, 10)
        dispatcher.close()


def test_status_answers_with_the_last_stored_values_while_the_store_does_not(tmp_path: Path) -> None:
    gate = threading.Event()
    gate.set()
    reads = [0]

    def read() -> dict:
        gate.wait(10)
        reads[0] += 1
        return {"recent_deployments": ["d1" if reads[0] == 1 else "d2"]}

    stored = BoundedRead(read, 0.2)
    assert stored.get({}) == ({"recent_deployments": ["d1"]}, True)
    gate.clear()  # the store stops answering (a writer of ours waits out another process's lock)
    started = time.monotonic()
    first, second = stored.get({}), stored.get({})
    assert first == second == ({"recent_deployments": ["d1"]}, False)
    assert time.monotonic() - started < 0.2 + FAST_S / 2  # the second joined the stuck read: no second wait
    gate.set()
    assert wait_for(lambda: stored.get({}) == ({"recent_deployments": ["d2"]}, True), 5)


def test_set_config_persistence_is_written_behind_and_merged(tmp_path: Path) -> None:
    gate, stop = threading.Event(), threading.Event()
    gate.set()
    written: list[tuple[dict, list]] = []
    handed: list[dict] = []  # every config_changed event the writer handed over, written or not

    def write(merged: dict, events: list) -> None:
        handed.extend(events)
        if not gate.wait(0.3):
            raise sqlite3.OperationalError("database is locked")
        written.append((merged, events))

    writer = ConfigWriter(write, stop.is_set)
    assert writer.persist({"log_level": "INFO"}, 1.0) is True
    gate.clear()
    started = time.monotonic()
    assert writer.persist({"telemetry_interval_s": 2.0}, 0.2) is False
    assert writer.persist({"telemetry_interval_s": 3.0, "results_rate_hz": 1.0}, 0.2) is False
    assert time.monotonic() - started < FAST_S
    gate.set()
    assert wait_for(lambda: written and written[-1][0] == {"telemetry_interval_s": 3.0, "results_rate_hz": 1.0}, 10)
    # one event per request, each handed over once (those of a failed try go out with that try)
    assert handed == [{"log_level": "INFO"}, {"telemetry_interval_s": 2.0},
                      {"telemetry_interval_s": 3.0, "results_rate_hz": 1.0}]
