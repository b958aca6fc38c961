"""A corrupt or half-written state.db, with real SQLite: quarantined and salvaged, durable commits, temp
files that no planted symlink can redirect (issue 12, "Hardening", items 1, 3 and 5).

Corruption is made by overwriting pages of a real state.db; the write lock is held by a second real sqlite3
connection (`BEGIN IMMEDIATE`). Locked databases and the workers that survive them: test_storage_faults.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import pytest

from agent.config.tree import AgentConfig
from agent.deployments.store import DeploymentStore
from agent.storage.state import StateStore, StateStoreError, integrity_problem, quarantine_if_corrupt
from kernel import fsutil
from kernel.errors import EdgeError
from kernel.fsutil import atomic_copy, atomic_write_bytes
from tests.helpers import WriteLock, wait_for
from tests.storage_fixtures import SHORT, filled_store, overwrite_pages


@pytest.fixture
def write_lock() -> Iterator[WriteLock]:
    """`hold(path)`: another connection takes the write lock (BEGIN IMMEDIATE) until `release()`."""
    held = WriteLock('IMMEDIATE')
    yield held
    held.release()


# --- item 3: a corrupt state.db is moved aside, the agent starts fresh ---------------------------

def test_corrupt_pages_are_quarantined_and_the_active_model_salvaged(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    filled_store(path)
    overwrite_pages(path, "events", pages=2)
    damaged = path.read_bytes()
    assert integrity_problem(path) is not None
    store = StateStore.open_checked(path)
    try:
        info = store.recovered
        assert info is not None and info["path"] == str(path)
        assert Path(info["quarantined"]).read_bytes() == damaged  # kept as found, for diagnosis
        assert info["salvaged"]["active_model"] == 2 and info["salvaged"]["engines"] == 0
        assert store.model_slot("active")["name"] == "b" and store.model_slot("previous")["name"] == "a"
        assert store.events(1) == [] and integrity_problem(path) is None
        store.add_event("after", {})  # a working store
    finally:
        store.close()


def test_quarantine_keeps_the_downgrade_memory(tmp_path: Path) -> None:
    """model_versions is salvaged: after a quarantine the first replay of an older version is refused."""
    from agent.deployments.versions import VersionMemory

    path = tmp_path / "state.db"
    filled_store(path)
    store = StateStore(path)
    VersionMemory(store).record("det", "5.0.0")  # a model no longer active or previous
    store.close()
    overwrite_pages(path, "events", pages=2)
    store = StateStore.open_checked(path)
    try:
        assert store.recovered is not None and store.recovered["salvaged"]["model_versions"] == 1
        memory = VersionMemory(store)
        assert memory.highest("det") == "5.0.0"
        with pytest.raises(EdgeError) as info:
            memory.check("det", "4.9.9", allow_downgrade=False)
        assert info.value.code == "ARTIFACT_DOWNGRADE"
    finally:
        store.close()


def test_unreadable_header_starts_fresh_and_says_what_was_lost(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    filled_store(path)
    overwrite_pages(path, "header")
    with pytest.raises(StateStoreError):
        StateStore(path)  # what the agent did before: no start, and systemd gives up after 5 tries
    store = StateStore.open_checked(path)
    try:
        assert "not a database" in store.recovered["problem"]
        assert store.recovered["salvaged"]["active_model"].startswith("lost:")
        assert store.model_slot("active") is None
    finally:
        store.close()


def test_healthy_or_locked_database_is_never_moved_aside(tmp_path: Path, write_lock) -> None:
    path = tmp_path / "state.db"
    filled_store(path)
    write_lock.hold(path)
    assert quarantine_if_corrupt(path, busy_timeout_s=SHORT) is None
    write_lock.release()
    store = StateStore.open_checked(path)
    try:
        assert store.recovered is None and store.model_slot("active")["name"] == "b"
    finally:
        store.close()
    assert [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name] == []


@pytest.mark.slow
def test_agent_starts_on_a_corrupt_state_db_and_reports_it(tmp_path: Path, mqtt_broker, collector_factory) -> None:
    from agent.daemon.runner import Agent
    from tests.deploy_fixtures import agent_settings, make_artifact, make_key

    private, public = make_key(tmp_path / "keys")
    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)
    settings = agent_settings(tmp_path, public, v1, device_id="sf-agent", mqtt={"url": mqtt_broker.url})
    db = tmp_path / "state" / "state.db"
    filled_store(db)
    overwrite_pages(db, "header")
    collector = collector_factory(mqtt_broker.url, ["edge/sf-agent/events"])
    agent = Agent(AgentConfig(**settings))
    try:
        agent.start()
        assert wait_for(lambda: agent.stats.frames >= 1, 60)
        assert collector.wait_for(lambda _m: any(e.get("type") == "state_db_quarantined"
                                                 for e in collector.payloads("edge/sf-agent/events")), 30)
    finally:
        agent.stop()
    event = next(e for e in collector.payloads("edge/sf-agent/events") if e["type"] == "state_db_quarantined")
    # no local path on the wire (issue 47): the event keeps a ref to the device log, the file is kept on disk
    assert str(db.parent) not in json.dumps(event) and "see the device log, ref" in event["quarantined"]
    assert list(db.parent.glob(f"{db.name}.corrupt-*"))
    assert "not a database" in event["problem"]


# --- item 1 and 3: durable commits --------------------------------------------------------------

def test_transitions_and_active_model_commit_with_synchronous_full(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    statements: list[str] = []
    store.db.conn.set_trace_callback(statements.append)
    deployments = DeploymentStore(store)
    dep = deployments.create("file:///m")
    deployments.transition(dep, "fetching")
    store.set_active_model("m", "1", "/m", "aa" * 32, {})
    store.add_event("cheap", {})  # everything else stays NORMAL
    store.db.conn.set_trace_callback(None)
    store.close()
    flow = [s for s in statements if s.startswith(("PRAGMA synchronous", "BEGIN", "COMMIT"))]
    durable = ["PRAGMA synchronous=FULL", "BEGIN IMMEDIATE", "COMMIT", "PRAGMA synchronous=NORMAL"]
    assert flow == durable * 3 + ["BEGIN IMMEDIATE", "COMMIT"]


# --- item 5: temp files are created exclusively, never through a planted symlink ------------------

def _plant(directory: Path, name: str, victim: Path) -> Path:
    link = directory / name
    link.symlink_to(victim)
    return link


@pytest.mark.parametrize("write", ["bytes", "copy"])
def test_planted_symlink_at_the_old_temp_name_is_not_followed(tmp_path: Path, write: str) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / "manifest.json"
    _plant(shared, f".{target.name}.{os.getpid()}.tmp", victim)  # the name the old code always used
    if write == "bytes":
        atomic_write_bytes(target, b"new")
    else:
        source = tmp_path / "src"
        source.write_bytes(b"new")
        atomic_copy(source, target)
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink() and target.read_bytes() == b"new"


def test_temp_name_collision_with_a_symlink_picks_another_name(tmp_path: Path, monkeypatch) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "engine.json"
    tokens = iter(["guessed0", "fresh001"])
    monkeypatch.setattr(fsutil.secrets, "token_hex", lambda _n: next(tokens))
    planted = _plant(tmp_path, f".{target.name}.{os.getpid()}.guessed0.tmp", victim)
    atomic_write_bytes(target, b"data", mode=0o644)
    assert victim.read_bytes() == b"precious" and planted.is_symlink()
    assert target.read_bytes() == b"data" and (target.stat().st_mode & 0o777) == 0o644


def test_default_mode_still_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "a", b"x")
        atomic_copy(tmp_path / "a", tmp_path / "b")
    finally:
        os.umask(old)
    assert {(tmp_path / n).stat().st_mode & 0o777 for n in "ab"} == {0o644}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
