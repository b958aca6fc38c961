"""Storage faults with real SQLite and a real broker: the command and deployment workers survive a locked or
failing state.db, finished deployments are pruned, requests are rate limited.

Each test reproduces a fault of issue 12 ("Hardening", item 2 and the growth limits). The write lock is held by a
second real sqlite3 connection (`BEGIN IMMEDIATE`), and busy timeouts are made short through parameters instead
of waiting the production 10 s. A corrupt state.db and planted symlinks: test_state_db_recovery.py.
"""

from __future__ import annotations

import inspect
import json
import logging
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent.artifacts.config import ArtifactsConfig
from agent.control.commands import CommandDispatcher
from agent.config.tree import AgentConfig
from agent.deployments.config import DeploymentConfig
from agent.deployments.manager import DeploymentManager
from agent.deployments.store import TERMINAL, DeploymentStore
from agent.mqtt.config import MqttConfig
from agent.mqtt.plane import MqttPlane
from agent.control.rate_limit import RateLimit
from agent.storage.state import StateStore
from deploy.mqtt_ops import send_command
from tests.fixtures_mqtt import FakeControl
from tests.helpers import WriteLock, wait_for
from tests.storage_fixtures import SHORT, overwrite_pages


# --- helpers ------------------------------------------------------------------------------------

@pytest.fixture
def write_lock() -> Iterator[Any]:
    """`hold(path)`: another connection takes the write lock (BEGIN IMMEDIATE) until `release()`."""
    held = WriteLock('IMMEDIATE')
    yield held
    held.release()


def _deploy_cmd(dispatcher: CommandDispatcher, url: str = "https://m/manifest.json", cid: str | None = None) -> dict:
    body = {"id": cid or uuid.uuid4().hex, "command": "deploy", "args": {"url": url}}
    return dispatcher.dispatch(json.dumps(body).encode())


# --- item 2: the MQTT command worker survives a locked or failing database -----------------------

@pytest.fixture
def short_timeout_plane(tmp_path: Path, mqtt_broker) -> Iterator[Any]:
    """A real MqttPlane whose dispatcher waits only SHORT seconds for the write lock."""
    made: list[tuple[MqttPlane, CommandDispatcher]] = []

    def make(device_id: str, dispatch: Any = None) -> MqttPlane:
        db = tmp_path / f"{device_id}.db"
        dispatcher = CommandDispatcher(FakeControl(), db, busy_timeout_s=SHORT)
        plane = MqttPlane(MqttConfig(url=mqtt_broker.url, reconnect_min_s=0.1, reconnect_max_s=1.0),
                          device_id=device_id, db_path=db, dispatch=dispatch or dispatcher.dispatch,
                          agent_version="test")
        made.append((plane, dispatcher))
        plane.start()
        assert wait_for(lambda: plane.connected, 10), plane.stats()
        return plane

    yield make
    for plane, dispatcher in made:
        plane.stop(timeout=5, flush_s=0)
        dispatcher.close()


def test_command_worker_survives_a_locked_state_db(tmp_path: Path, mqtt_broker, short_timeout_plane,
                                                   write_lock) -> None:
    plane = short_timeout_plane("sf-lock")
    write_lock.hold(tmp_path / "sf-lock.db")
    # the reply cannot be remembered (write lock held elsewhere): the command still gets its answer
    first = send_command(mqtt_broker.url, "sf-lock", "ping", timeout_s=10)
    assert first["ok"] is True, first
    second = send_command(mqtt_broker.url, "sf-lock", "status", timeout_s=10)
    assert second["ok"] is True, second
    write_lock.release()
    third = send_command(mqtt_broker.url, "sf-lock", "ping", timeout_s=10)
    assert third["ok"] is True and plane.worker._thread.is_alive()
    assert plane.stats()["commands_handled"] == 3


def test_command_worker_answers_internal_when_dispatch_raises_and_keeps_going(mqtt_broker,
                                                                            short_timeout_plane) -> None:
    def dispatch(payload: bytes) -> dict:
        if b"boom" in payload:
            raise sqlite3.OperationalError("disk I/O error")
        return {"id": json.loads(payload)["id"], "ok": True, "result": {"pong": True}}

    plane = short_timeout_plane("sf-raise", dispatch=dispatch)
    bad = send_command(mqtt_broker.url, "sf-raise", "boom", timeout_s=10, command_id="boom-1")
    assert bad["id"] == "boom-1" and bad["ok"] is False and bad["error"]["code"] == "INTERNAL"
    good = send_command(mqtt_broker.url, "sf-raise", "ping", timeout_s=10)
    assert good["ok"] is True and plane.stats()["commands_internal"] == 1


# --- INTERNAL on the wire: generic text and a ref; the exception text only in the device log ----------

SECRET_DETAIL = "/var/lib/edge-agent/private/keys/fleet.key: SELECT * FROM kv"


def _logged_under_ref(message: str, caplog: pytest.LogCaptureFixture) -> bool:
    """`message` is the generic wire text; a log record with its ref carries the exception's detail."""
    import re

    match = re.fullmatch(r"internal error; see the device log, ref ([0-9a-f]{8})", message)
    assert match is not None, message
    return any(match[1] in r.getMessage() and SECRET_DETAIL in (r.exc_text or "") for r in caplog.records)


def test_command_worker_internal_reply_hides_the_exception(mqtt_broker, short_timeout_plane, caplog) -> None:
    def dispatch(payload: bytes) -> dict:
        raise sqlite3.OperationalError(SECRET_DETAIL)

    short_timeout_plane("sf-hide", dispatch=dispatch)
    with caplog.at_level(logging.ERROR):
        bad = send_command(mqtt_broker.url, "sf-hide", "ping", timeout_s=10, command_id="hide-1")
    assert bad["error"]["code"] == "INTERNAL" and "fleet.key" not in json.dumps(bad)
    assert _logged_under_ref(bad["error"]["message"], caplog)


class CrashingControl(FakeControl):
    """A daemon whose engines command hits an unexpected error carrying paths and SQL."""

    def engines(self) -> list[dict]:
        raise OSError(SECRET_DETAIL)


def test_dispatcher_internal_replies_hide_the_exception(tmp_path: Path, caplog,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    dispatcher = CommandDispatcher(CrashingControl(), tmp_path / "state.db")
    try:
        with caplog.at_level(logging.ERROR):
            crashed = dispatcher.dispatch(b'{"id": "e1", "command": "engines"}')
            # a bug in the dispatcher itself (outside the handler) is answered the same way
            monkeypatch.setattr(dispatcher.replies, "get", lambda _id: (_ for _ in ()).throw(KeyError(SECRET_DETAIL)))
            broken = dispatcher.dispatch(b'{"id": "e2", "command": "ping"}')
    finally:
        dispatcher.close()
    for reply in (crashed, broken):
        assert reply["error"]["code"] == "INTERNAL" and "fleet.key" not in json.dumps(reply), reply
        assert _logged_under_ref(reply["error"]["message"], caplog), reply


def test_crashed_deployment_fails_with_generic_text_and_a_ref(tmp_path: Path, manager_factory, caplog) -> None:
    manager, events = manager_factory()

    def crash(dep: Any, options: Any) -> Path:
        raise RuntimeError(SECRET_DETAIL)

    manager._fetch = crash  # an unexpected error inside a deployment step
    with caplog.at_level(logging.ERROR):
        dep_id = _request(manager, _missing_url(tmp_path))
        manager.start()
        assert wait_for(lambda: manager.store.get(dep_id).state == "failed", 10)
    failed = manager.store.get(dep_id)
    sent = [f for t, f in events if f.get("deployment_id") == dep_id and f.get("state") == "failed"]
    assert failed.reason == "INTERNAL" and sent and "fleet.key" not in json.dumps(sent)
    assert _logged_under_ref(failed.message, caplog) and sent[0]["message"] == failed.message


def test_corrupt_reply_table_answers_internal_without_running(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    first = CommandDispatcher(FakeControl(), db)
    for i in range(200):
        first.dispatch(json.dumps({"id": f"fill-{i:04d}-" + "x" * 60, "command": "ping"}).encode())
    conn = sqlite3.connect(str(db))
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    first.close()
    overwrite_pages(db, "command_replies", pages=3)
    control = FakeControl()
    dispatcher = CommandDispatcher(control, db)
    try:
        reply = dispatcher.dispatch(b'{"id": "after", "command": "status"}')  # old code: raised DatabaseError
    finally:
        dispatcher.close()
    assert reply["ok"] is False and reply["error"]["code"] == "INTERNAL"
    assert "state database unavailable" in reply["error"]["message"] and control.calls == []


# --- item 2: the deployment worker survives a locked database ------------------------------------

@pytest.fixture
def manager_factory(tmp_path: Path) -> Iterator[Any]:
    """DeploymentManagers on a real StateStore (short busy timeout); no host: these deploys fail at fetch."""
    made: list[tuple[DeploymentManager, threading.Event, StateStore]] = []

    def make(**config: Any) -> tuple[DeploymentManager, list]:
        store = StateStore(tmp_path / "state.db", busy_timeout_s=SHORT)
        events: list[tuple[str, dict]] = []
        stop = threading.Event()
        manager = DeploymentManager(DeploymentStore(store), None, tmp_path / "artifacts",
                                    ArtifactsConfig(), DeploymentConfig(**config),
                                    lambda type_, **f: events.append((type_, f)), stop)
        made.append((manager, stop, store))
        return manager, events

    yield make
    for manager, stop, store in made:
        stop.set()
        if manager.is_alive():
            manager.join(10)
        store.close()


def _missing_url(tmp_path: Path, name: str = "missing") -> str:
    return (tmp_path / name / "manifest.json").as_uri()


def _request(manager: DeploymentManager, url: str) -> str:
    """A deploy as `edge-agent deploy` sends it (file:// URLs are for the local socket where channels exist)."""
    local = {"channel": "local"} if "channel" in inspect.signature(manager.request).parameters else {}
    return manager.request(url, **local)["deployment_id"]


def _failed(events: list, dep_id: str) -> bool:
    return any(t == "deployment" and f.get("deployment_id") == dep_id and f.get("state") == "failed"
               for t, f in list(events))


def test_deployment_worker_survives_a_locked_state_db(tmp_path: Path, manager_factory, write_lock) -> None:
    manager, events = manager_factory()
    first = _request(manager, _missing_url(tmp_path))
    write_lock.hold(tmp_path / "state.db")
    manager.start()  # `fetching` cannot be recorded; nor can `failed` (old code: the thread died here)
    assert wait_for(lambda: _failed(events, first), 10)
    assert manager.is_alive()
    write_lock.release()
    assert wait_for(lambda: manager.store.get(first).state == "failed", 10)  # recorded once the lock is gone
    assert manager.store.get(first).reason == "INTERNAL"
    second = _request(manager, _missing_url(tmp_path, "other"))
    assert wait_for(lambda: manager.store.get(second).state == "failed", 10)
    assert manager.store.get(second).reason == "ARTIFACT_NOT_FOUND" and manager.is_alive()


# --- item 4: pruning and rate limiting -----------------------------------------------------------

def test_finished_deployments_are_pruned_to_keep_deployments(tmp_path: Path, manager_factory) -> None:
    manager, events = manager_factory(keep_deployments=5)
    store = manager.store
    pinned = store.create("file:///pinned/manifest.json")  # the deployment of the model now active
    store.state.set_active_model("m", "1", "/m", "cc" * 32, {"deployment_id": pinned.id})
    manager.start()
    ids = []
    for i in range(20):
        ids.append(_request(manager, _missing_url(tmp_path, f"m{i}")))
        assert wait_for(lambda: _failed(events, ids[-1]), 10)
    assert wait_for(lambda: len(store.latest(100)) == 6, 10), [d.id for d in store.latest(100)]
    kept = {d.id for d in store.latest(100)}
    assert kept == {pinned.id, *ids[-5:]}
    left = store.state.query("SELECT DISTINCT deployment_id FROM deployment_transitions")
    assert {row["deployment_id"] for row in left} == kept


def test_prune_never_touches_deployments_in_progress(tmp_path: Path) -> None:
    store = DeploymentStore(StateStore(tmp_path / "state.db"))
    running = store.create("file:///running")
    store.transition(running, "fetching")
    for i in range(4):
        dep = store.create(f"file:///{i}")
        store.transition(dep, "failed", reason="ARTIFACT_NOT_FOUND")
    assert store.prune(keep=1) == 3
    states = sorted(d.state for d in store.latest(10))
    assert states == ["failed", "fetching"] and set(states) - TERMINAL == {"fetching"}
    store.state.close()


def test_deploy_requests_are_rate_limited(tmp_path: Path) -> None:
    control = FakeControl()
    dispatcher = CommandDispatcher(control, tmp_path / "state.db", deploy_rate=RateLimit(3, 60.0))
    try:
        assert all(_deploy_cmd(dispatcher)["ok"] for _ in range(3))
        limited = _deploy_cmd(dispatcher, cid="fourth")
        assert limited["error"]["code"] == "RATE_LIMITED" and "retry in" in limited["error"]["message"]
        assert dispatcher.dispatch(b'{"id": "p", "command": "ping"}')["ok"]  # other commands are not limited
        assert len(control.calls) == 3
    finally:
        dispatcher.close()


def test_rate_limited_deploy_runs_once_the_window_has_room(tmp_path: Path) -> None:
    control = FakeControl()
    dispatcher = CommandDispatcher(control, tmp_path / "state.db", deploy_rate=RateLimit(1, 0.2))
    try:
        assert _deploy_cmd(dispatcher)["ok"]
        assert _deploy_cmd(dispatcher, cid="again")["error"]["code"] == "RATE_LIMITED"
        assert wait_for(lambda: _deploy_cmd(dispatcher, cid="again")["ok"], 10)  # not remembered as refused
        assert len(control.calls) == 2
    finally:
        dispatcher.close()


def test_every_command_has_a_rate_limit_on_its_spec(tmp_path: Path) -> None:
    """Issue 19: only deploy was limited, so a restart_pipeline flood halted inference. The limit is a field of
    each command's spec, counted per command and channel; the config can override one (deploy's)."""
    from agent.control.commands import COMMANDS

    specs = {name: COMMANDS.get(name) for name in COMMANDS.names()}
    assert specs and all(spec.per_minute > 0 for spec in specs.values()), specs
    control = FakeControl()
    dispatcher = CommandDispatcher(control, tmp_path / "state.db", limits={"rollback": 2})
    try:
        flood = [dispatcher.dispatch(json.dumps({"id": uuid.uuid4().hex, "command": "restart_pipeline"}).encode())
                 for _ in range(specs["restart_pipeline"].per_minute + 5)]
        limited = [r for r in flood if not r["ok"]]
        assert len(limited) == 5 and all(r["error"]["code"] == "RATE_LIMITED" for r in limited)
        assert "restart_pipeline requests from mqtt" in limited[0]["error"]["message"]
        local = json.dumps({"id": "l1", "command": "restart_pipeline"}).encode()
        assert dispatcher.dispatch(local, channel="local")["ok"]  # the local socket has its own window
        rollbacks = [dispatcher.dispatch(json.dumps({"id": f"r{i}", "command": "rollback"}).encode()) for i in range(3)]
        assert [r["ok"] for r in rollbacks] == [True, True, False]  # the override
        assert dispatcher.dispatch(b'{"id": "p", "command": "ping"}')["ok"]
    finally:
        dispatcher.close()


class PolicyControl(FakeControl):
    """FakeControl whose deploy applies the real URL policy of the channel, as the deployment manager does."""

    def deploy(self, url: str, timeout_s: float | None, **options: Any) -> dict:
        from agent.artifacts.urlpolicy import check_url

        check_url(url, ArtifactsConfig(), options.get("channel", "mqtt"))
        return super().deploy(url, timeout_s, **options)


def test_refused_urls_use_no_tokens_and_each_channel_has_its_own_window(tmp_path: Path) -> None:
    control = PolicyControl()
    dispatcher = CommandDispatcher(control, tmp_path / "state.db", deploy_rate=RateLimit(3, 60.0))

    def deploy(url: str, channel: str) -> dict:
        body = {"id": uuid.uuid4().hex, "command": "deploy", "args": {"url": url}}
        return dispatcher.dispatch(json.dumps(body).encode(), channel=channel)

    try:
        refused = [deploy("file:///etc/passwd", "mqtt")["error"]["code"] for _ in range(10)]
        assert refused == ["ARTIFACT_URL_REFUSED"] * 10  # refused by the URL check, never RATE_LIMITED
        assert all(deploy("https://m/manifest.json", "mqtt")["ok"] for _ in range(3))
        assert deploy("https://m/manifest.json", "mqtt")["error"]["code"] == "RATE_LIMITED"
        assert all(deploy("file:///srv/m/manifest.json", "local")["ok"] for _ in range(3))  # its own window
        limited = deploy("https://m/manifest.json", "local")["error"]
        assert limited["code"] == "RATE_LIMITED" and "from local" in limited["message"]
        assert [c for c, _ in control.calls] == ["deploy"] * 6
    finally:
        dispatcher.close()


def test_agent_config_has_storage_limits_by_default() -> None:
    deployments = AgentConfig().deployments
    assert deployments.keep_deployments >= 5 and deployments.max_requests_per_minute > 0
