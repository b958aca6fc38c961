"""A full disk sheds what it can (issue 19): failed downloads, unused artifacts, the live-frame sample, other
models' engines, the oldest outbox telemetry, each drop counted in a `storage_reclaimed` event, while
inference goes on.

The full disk is real SQLite's: `PRAGMA max_page_count` at the database's size makes the next write that
needs a page fail with SQLITE_FULL ("database or disk is full"), exactly what a full filesystem gives it.
"""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import pytest

from agent.config.tree import AgentConfig
from agent.mqtt.outbox import Outbox
from agent.daemon.runner import Agent
from agent.storage.health import StorageHealth, disk_full
from agent.storage.reclaim import reclaim
from tests.deploy_fixtures import agent_settings, make_artifact, make_key
from tests.helpers import wait_for


def _files(root: Path, names: dict[str, int]) -> None:
    for name, size in names.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)


def test_reclaim_drops_the_cheapest_first_and_counts_every_drop(tmp_path: Path) -> None:
    artifacts, live = tmp_path / "artifacts", tmp_path / "live"
    _files(artifacts, {"a.partial": 100, "old-1/manifest.json": 1000, "old-1/model.onnx": 4000,
                       "active/manifest.json": 10, "previous/model.onnx": 20})
    _files(live, {"0001-cam0.png": 300, "0002-cam0.png": 300})

    def failing(out) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    result = reclaim(artifacts, {artifacts / "active", artifacts / "previous"}, live,
                     [("outbox_telemetry", lambda out: out.add("outbox_telemetry", 7, 700)), ("engines", failing)])
    assert result.items == {"partials": 1, "artifacts": 1, "live_frames": 2, "outbox_telemetry": 7}
    assert result.bytes == {"partials": 100, "artifacts": 5000, "live_frames": 600, "outbox_telemetry": 700}
    assert result.failed == {"engines": "OperationalError"} and result.total_bytes == 6400
    assert sorted(p.name for p in artifacts.iterdir()) == ["active", "previous"]  # what serves is never shed


def test_a_full_disk_is_told_from_other_storage_errors_and_reclaimed_at_most_once_a_minute() -> None:
    assert disk_full(sqlite3.OperationalError("database or disk is full"))
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not disk_full(sqlite3.OperationalError("database is locked"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))
    events: list[tuple] = []
    calls: list[int] = []
    health = StorageHealth(lambda kind, **f: events.append((kind, f)), on_full=lambda: calls.append(1))
    for _ in range(3):
        with health.guard("live status"):
            raise sqlite3.OperationalError("database or disk is full")
    with health.guard("run summary"):
        raise sqlite3.OperationalError("database is locked")
    assert calls == [1] and events[0][0] == "storage_degraded" and events[0][1]["disk_full"] is True


def test_the_outbox_sheds_its_oldest_telemetry_and_keeps_events(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "s.db")
    box.enqueue_many("telemetry", "t", [{"i": i} for i in range(10)])
    box.enqueue("event", "e", {"type": "deployment"})
    rows, size = box.shed_telemetry(0.5)
    assert rows == 5 and size > 0
    kinds = [r.topic for r in box.fetch(0)]
    assert kinds.count("t") == 5 and kinds.count("e") == 1
    box.close()
    again = Outbox(tmp_path / "s.db")
    assert again._dropped["dropped_telemetry"] == 5  # counted like any eviction, and persisted
    again.close()


@pytest.mark.slow
def test_a_running_agent_on_a_full_disk_sheds_and_keeps_serving(tmp_path: Path) -> None:
    private, public = make_key(tmp_path / "keys")
    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)
    events: list[tuple] = []
    settings = agent_settings(tmp_path, public, v1, gates={"live_frames": 4, "live_frames_interval_s": 0.2})
    agent = Agent(AgentConfig(**settings), on_event=lambda kind, **f: events.append((kind, f)))
    agent.start()
    try:
        state = Path(settings["state_dir"])
        _files(state / "artifacts" / "deployed", {"failed-2.0.0/manifest.json": 50_000, "x.partial": 10_000})
        assert wait_for(lambda: agent.live_frames.written >= 2, timeout=60)
        conn = agent.store.db.conn
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full now
        with agent.storage.guard("a big write"):
            conn.execute("CREATE TABLE IF NOT EXISTS filler (b BLOB)")
            conn.execute("INSERT INTO filler VALUES (zeroblob(1000000))")
        assert agent.storage.degraded
        reclaimed = [f for kind, f in events if kind == "storage_reclaimed"]
        assert reclaimed, [k for k, _ in events]
        assert reclaimed[0]["items"]["artifacts"] == 1 and reclaimed[0]["items"]["partials"] == 1
        assert reclaimed[0]["items"]["live_frames"] >= 2 and reclaimed[0]["freed_bytes"] >= 60_000
        assert not (state / "artifacts" / "deployed" / "failed-2.0.0").exists()
        frames = agent.stats.frames
        assert wait_for(lambda: agent.stats.frames > frames + 2, timeout=30), "inference stopped on a full disk"
        conn.execute("PRAGMA max_page_count = 1073741823")  # room again
        agent.persist_live()
        assert wait_for(lambda: not agent.storage.degraded, timeout=10)
        assert any(kind == "storage_recovered" for kind, _ in events)
    finally:
        agent.stop()


def test_a_start_on_a_nearly_full_disk_sheds_what_needs_no_database(tmp_path: Path, monkeypatch) -> None:
    """Measured on a real 24 MB tmpfs filled to 0 bytes free (docs/deployments.md): the agent started after
    shedding a 6 MB unused artifact, and with nothing to shed it said STORAGE_FULL and the bytes free instead
    of "disk I/O error". Here the free-space reading is pinned, the files and state.db are real."""
    import agent.storage.reclaim as sr
    from agent.storage.state import StateStore

    state = tmp_path / "state"
    deployed = state / "artifacts" / "deployed"
    _files(deployed, {"serving/model.onnx": 100, "stale/model.onnx": 5000, "y.partial": 10})
    store = StateStore(state / "state.db")
    store.set_active_model("m", "1.0.0", str(deployed / "serving"), "ab" * 32, {})
    store.close()
    monkeypatch.setattr(sr, "free_bytes", lambda path: 0)
    shed = sr.reclaim_before_start(state, None, state / "state.db")
    assert shed is not None and shed.items == {"partials": 1, "artifacts": 1} and shed.bytes["artifacts"] == 5000
    assert sorted(p.name for p in deployed.iterdir()) == ["serving"]  # read from state.db without writing it
    monkeypatch.setattr(sr, "free_bytes", lambda path: 10**9)
    assert sr.reclaim_before_start(state, None, state / "state.db") is None  # room: nothing touched
    (state / "state.db").write_bytes(b"not a database")  # unreadable: no artifact is safe to delete
    _files(deployed, {"other/model.onnx": 10})
    monkeypatch.setattr(sr, "free_bytes", lambda path: 0)
    assert "other" in [p.name for p in deployed.iterdir()] and sr.reclaim_before_start(
        state, None, state / "state.db").items == {}
    assert (deployed / "other").is_dir()


def test_an_agent_that_cannot_open_its_store_on_a_full_disk_waits_says_so_and_starts(tmp_path: Path, monkeypatch,
                                                                                       caplog) -> None:
    """Issue 47: it used to exit with STORAGE_FULL (a restart loop under systemd). Now it waits with backoff,
    the log naming STORAGE_FULL, the directory and the bytes free, and starts once the store opens."""
    import agent.storage.reclaim as sr
    from agent.storage.state import StateStore, StateStoreError

    private, public = make_key(tmp_path / "keys")
    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)
    monkeypatch.setattr(sr, "free_bytes", lambda path: 123)
    backoff = sr.Backoff
    monkeypatch.setattr(sr, "Backoff", lambda: backoff(0.01, 0.05))
    real_open, tries = StateStore.open_checked, []

    def no_room_twice(cls, path, **kwargs):  # what SQLite says on a full tmpfs
        tries.append(path)
        if len(tries) <= 2:
            raise StateStoreError(f"{path}: cannot open state database") from sqlite3.OperationalError("disk I/O error")
        return real_open(path, **kwargs)

    monkeypatch.setattr(StateStore, "open_checked", classmethod(no_room_twice))
    agent = Agent(AgentConfig(**agent_settings(tmp_path, public, v1)))
    try:
        agent.start()
        assert len(tries) == 3 and agent.state == "running" and agent.active is not None
        waits = [r.getMessage() for r in caplog.records if "the agent waits and tries again" in r.getMessage()]
        assert len(waits) == 2 and waits[0].startswith("STORAGE_FULL") and "123 bytes free" in waits[0], waits
        assert "state_dir" in waits[0] and str(tmp_path) in waits[0]
    finally:
        agent.stop()


def test_a_stop_while_waiting_for_the_store_ends_the_start_cleanly(tmp_path: Path, monkeypatch) -> None:
    """SIGTERM while the store cannot open: start returns, stop ends cleanly (the CLI exits 0), nothing leaks."""
    import threading

    import agent.storage.reclaim as sr
    from agent.storage.state import StateStore, StateStoreError

    private, public = make_key(tmp_path / "keys")
    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)
    waiting, backoff = threading.Event(), sr.Backoff
    monkeypatch.setattr(sr, "Backoff", lambda: (waiting.set(), backoff(30.0, 30.0))[1])

    def locked(cls, path, **kwargs):
        raise StateStoreError(f"{path}: cannot open state database") from sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(StateStore, "open_checked", classmethod(locked))
    agent = Agent(AgentConfig(**agent_settings(tmp_path, public, v1)))
    starter = threading.Thread(target=agent.start)
    starter.start()
    assert waiting.wait(30)
    agent.stop_event.set()  # what the SIGTERM handler does
    starter.join(10)
    assert not starter.is_alive() and agent.store is None and agent.active is None
    summary = agent.stop()
    assert summary["frames"] == 0 and agent.state == "stopped"


@pytest.mark.parametrize("code, kept", [("ARTIFACT_FETCH_CANCELLED", True), ("ARTIFACT_FETCH_FAILED", True),
                                        ("ARTIFACT_HASH_MISMATCH", False)])
def test_a_cancelled_or_broken_download_keeps_its_partial_files_for_a_resume(tmp_path: Path, code: str,
                                                                              kept: bool) -> None:
    """docs/deployments.md: a cancelled fetch keeps `*.partial` for a resume; bytes that failed verification go.
    (The set once held `CANCELLED`, a code nothing sends, so a cancelled download lost its partial files.)"""
    from types import SimpleNamespace

    from agent.deployments.manager import DeploymentManager

    artifacts = tmp_path / "deployed"
    _files(artifacts, {"det-2.0.0.partial/.incoming/ab.part": 1000})
    recorded: list[tuple[str, str]] = []
    host = SimpleNamespace(
        artifacts_dir=artifacts,
        _unrecorded=[],
        emit=lambda *a, **k: None,
        store=SimpleNamespace(transition=lambda dep, state, **kw: recorded.append((state, kw["reason"]))),
        _drop_failed_artifact=lambda dep: None,
    )
    DeploymentManager._fail(host, SimpleNamespace(id="d1"), code, "stopped")
    assert (artifacts / "det-2.0.0.partial").exists() is kept and recorded == [("failed", code)]
