"""Issue 47, item 7: SIGTERM right after a swap must not let a model skip its watch.

A real agent process (the `edge-agent run` CLI) on a camera replaying dark frames deploys a model that passes
its gate and is slow on those frames (tests/slow_model.py: about 150 ms a frame against a 20 ms budget). It is
stopped with SIGTERM 1 s after the swap, before its watch could judge it (`watch_min_s` 3 s), then started
again: the row must say how much of the window was left, and the next start must take the watch up for that
and roll the model back.

Before the fix the watch ended with the process, nothing recorded it, and the restarted agent served the
slow model for good.

Beside it, the manager's side on a real state store with a stand-in host: what a resumed watch is given, and
the cases where it cannot go on (its model is not the one serving; its record cannot be read; the watch fails).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent.artifacts.config import ArtifactsConfig
from agent.control.control_socket import send_command
from agent.deployments.config import DeploymentConfig
from agent.deployments.manager import DeploymentManager
from agent.deployments.store import Deployment, DeploymentStore
from agent.deployments.watch import WatchWindow, watch_model
from agent.storage.state import StateStore
from tests.deploy_fixtures import make_artifact, make_key
from tests.helpers import wait_for
from tests.slow_model import dark_frames, slow_on_dark_onnx, steps_for_ms

WINDOW_S = 60.0


def write_config(tmp: Path, public: Path, bootstrap: Path, frames: Path) -> Path:
    path = tmp / "agent.toml"
    path.write_text(f"""
device_id = "watch-resume"
state_dir = "{tmp / 'state'}"
cache_dir = "{tmp / 'cache'}"
[model]
path = "{bootstrap}"
warmup_runs = 1
[camera]
kind = "file"
path = "{frames}"
loop = true
fps = 10
[artifacts]
trusted_keys = ["{public}"]
[engines]
validation_samples = 2
latency_runs = 3
[deployments]
watch_window_s = {WINDOW_S}
watch_min_s = 3.0
""")
    return path


def start_agent(config: Path, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    with log.open("a") as out:
        return subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(config)], env=env,
                                stdout=subprocess.DEVNULL, stderr=out)


def stop_agent(proc: subprocess.Popen) -> int:
    """SIGTERM, as systemd stops it; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        raise


def deployment(state_db: Path, dep_id: str) -> dict[str, Any]:
    """The row as it is now, read beside the running agent (read-only)."""
    conn = sqlite3.connect(f"file:{state_db}?mode=ro", uri=True, timeout=10)
    try:
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT state, reason, details FROM deployments WHERE id = ?", (dep_id,)).fetchone()
        active = conn.execute("SELECT name, version FROM active_model WHERE slot = 'active'").fetchone()
    finally:
        conn.close()
    if row is None:
        return {}
    return {"state": row["state"], "reason": row["reason"], "details": json.loads(row["details"] or "{}"),
            "active": dict(active) if active else None}


@pytest.mark.slow
def test_sigterm_one_second_after_a_swap_then_restart_resumes_the_watch_and_rolls_back(tmp_path: Path) -> None:
    private, public = make_key(tmp_path / "keys")
    bootstrap = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)  # demo-det: fast on any frame
    # ~150 ms a dark frame against a 20 ms budget: a margin that holds when the timing of the steps is off by
    # several times (on a loaded machine one calibration gave a sixth of what it aimed at)
    slow = slow_on_dark_onnx(tmp_path / "slow.onnx", steps_for_ms(tmp_path, 150.0))
    url = (make_artifact(tmp_path / "pub" / "slow", "1.0.0", private, name="slow", size=(64, 64), onnx=slow,
                         postprocess="raw", budget_ms=20.0) / "manifest.json").as_uri()
    config = write_config(tmp_path, public, bootstrap, dark_frames(tmp_path / "night"))
    state_db, sock, log = tmp_path / "state" / "state.db", tmp_path / "state" / "control.sock", tmp_path / "agent.log"

    proc = start_agent(config, log)
    try:
        assert wait_for(sock.exists, timeout=180), f"agent did not start: {log.read_text()[-2000:]}"
        reply = send_command(sock, "deploy", {"url": url})
        assert reply["ok"], reply
        dep_id = reply["result"]["deployment_id"]
        assert wait_for(lambda: deployment(state_db, dep_id).get("state") == "active", timeout=240), \
            f"never swapped: {deployment(state_db, dep_id)} {log.read_text()[-2000:]}"
        time.sleep(1.0)  # the scenario: a stop 1 s after the swap, well before the watch can judge (3 s)
    finally:
        assert stop_agent(proc) == 0, log.read_text()[-2000:]

    stopped = deployment(state_db, dep_id)
    assert stopped["state"] == "active" and stopped["active"]["name"] == "slow", stopped
    window = stopped["details"].get("watch_window")
    assert window is not None and window["pending"] is True, f"the row does not say a watch was cut short: {stopped}"
    assert window["window_s"] == WINDOW_S and WINDOW_S - 30 < window["remaining_s"] < WINDOW_S, window

    proc = start_agent(config, log)
    try:
        assert wait_for(lambda: deployment(state_db, dep_id).get("state") == "rolled_back", timeout=240), \
            f"the restarted agent kept the model: {deployment(state_db, dep_id)} {log.read_text()[-2000:]}"
    finally:
        assert stop_agent(proc) == 0, log.read_text()[-2000:]
    ended = deployment(state_db, dep_id)
    watch = ended["details"]["watch"]
    assert ended["reason"] in ("WATCH_LATENCY", "WATCH_FPS") and ended["reason"] == watch["reason"], ended
    assert watch["resumed"] == {"times": 1, "window_s": window["remaining_s"]}, watch  # what was left, no more
    assert ended["details"]["watch_window"]["pending"] is False
    assert ended["active"] == {"name": "demo-det", "version": "1.0.0"}, ended


# --- the record and the manager, with a stand-in host -----------------------------------------------------

def test_a_resumed_window_is_what_was_left_but_never_too_short_to_judge() -> None:
    opened = WatchWindow.opening(60.0)
    assert WatchWindow.of(opened.details()) == opened and opened.pending and opened.remaining_s == 60.0
    cut = opened.cut_short(20.0)
    assert (cut.remaining_s, cut.pending) == (40.0, True)
    assert cut.resuming(5.0) == (WatchWindow(60.0, 40.0, True, 1), 40.0)
    nearly = opened.cut_short(59.0)
    assert nearly.resuming(5.0)[1] == 5.0  # a second left would judge nothing: the judging minimum
    assert WatchWindow.opening(2.0).cut_short(1.5).resuming(5.0)[1] == 2.0  # never more than the whole window
    assert WatchWindow.of({}) is None and not cut.ended().pending and cut.ended().remaining_s == 0.0
    for bad in ({"window_s": "x"}, {"window_s": 1.0, "remaining_s": 2.0, "pending": True}, "nonsense"):
        with pytest.raises(ValueError):
            WatchWindow.of({"watch_window": bad})


def test_watch_model_takes_the_window_it_is_given() -> None:
    """A resumed watch passes what was left; the config's window (60 s here) is not waited for."""
    from tests.test_watch import Cameras, Windows, stats

    worker = Windows(model_age_s=0.0, a=stats([20.0] * 12, age_s=0.0))
    cfg = DeploymentConfig(watch_window_s=60.0, watch_min_s=5.0, watch_min_frames=10)
    started = time.monotonic()
    verdict = watch_model(worker, Cameras(names=("a",)), cfg, 100.0, threading.Event(), {}, lambda: True,
                          window_s=0.5)
    assert verdict is None and time.monotonic() - started < 30  # judged at its end, fine


class Host:
    """The few calls the manager makes on the agent for a watch and a rollback; records them."""

    def __init__(self, verdict: dict[str, Any] | None = None, fails: bool = False) -> None:
        self.verdict, self.fails = verdict, fails
        self.watched: list[float] = []
        self.rollbacks: list[str] = []
        self.stop_during_watch: threading.Event | None = None

    def watch(self, dep: Deployment, stop: threading.Event, window_s: float) -> dict[str, Any] | None:
        self.watched.append(window_s)
        if self.fails:
            raise RuntimeError("no worker")
        if self.stop_during_watch is not None:
            self.stop_during_watch.set()
        return dict(self.verdict) if self.verdict else None

    def rollback(self, reason: str, numbers: dict[str, Any] | None = None) -> dict[str, Any]:
        self.rollbacks.append(reason)
        return {"model": {"name": "det", "version": "1.0.0"}}


@pytest.fixture
def state(tmp_path: Path) -> Iterator[StateStore]:
    store = StateStore(tmp_path / "state.db")
    yield store
    store.close()


def watched_row(state: StateStore, record: dict[str, Any] | None, sha: str = "a" * 64,
                serving: str | None = None) -> Deployment:
    """A deployment made active with `record` as its watch record, its model (or `serving`) the active one."""
    store = DeploymentStore(state)
    dep = store.create("file:///m/manifest.json")
    for step in ("fetching", "verifying"):
        store.transition(dep, step)
    store.transition(dep, "building", model_name="det", model_version="2.0.0", sha256=sha)
    store.transition(dep, "ready")
    store.transition(dep, "activating", details={"watch_window": record} if record is not None else {})
    state.set_active_model("det", "2.0.0", "/m", serving or sha, {"deployment_id": None})
    store.transition(dep, "active")
    return dep


def manager(state: StateStore, host: Host, tmp_path: Path, stop: threading.Event | None = None,
            **config: Any) -> tuple[DeploymentManager, list[tuple[str, dict]]]:
    events: list[tuple[str, dict]] = []
    made = DeploymentManager(DeploymentStore(state), host, tmp_path / "deployed",
                             ArtifactsConfig(), DeploymentConfig(**config),
                             lambda kind, **fields: events.append((kind, fields)), stop or threading.Event())
    return made, events


def test_a_resumed_watch_gets_what_was_left_and_rolls_back_on_its_verdict(state: StateStore, tmp_path: Path) -> None:
    dep = watched_row(state, WatchWindow(60.0, 12.5).details()["watch_window"])
    host = Host({"reason": "WATCH_LATENCY", "message": "p50 60 ms > budget 20 ms", "limit": 20.0, "value": 60.0})
    made, events = manager(state, host, tmp_path, watch_min_s=5.0)
    made.resume_watch()
    row = made.store.get(dep.id)
    assert host.watched == [12.5] and host.rollbacks == ["watch"]
    assert (row.state, row.reason) == ("rolled_back", "WATCH_LATENCY")
    assert row.details["watch"]["resumed"] == {"times": 1, "window_s": 12.5}
    assert row.details["watch_window"]["pending"] is False
    assert [kind for kind, _ in events] == ["rolled_back"] and made.watched() is None


def test_a_resumed_watch_that_passes_or_is_stopped_again_says_so(state: StateStore, tmp_path: Path) -> None:
    dep = watched_row(state, WatchWindow(60.0, 1.0).details()["watch_window"])
    stop = threading.Event()
    host = Host()
    host.stop_during_watch = stop  # stopped again: still pending, what is left recorded (at least min_s given)
    made, _ = manager(state, host, tmp_path, stop, watch_min_s=5.0)
    made.resume_watch()
    record = WatchWindow.of(made.store.get(dep.id).details)
    assert host.watched == [5.0] and record.pending and record.resumed == 1 and 0 < record.remaining_s <= 5.0
    host.stop_during_watch = None
    made, _ = manager(state, host, tmp_path, watch_min_s=5.0)
    made.resume_watch()  # judged to its end and passed
    row = made.store.get(dep.id)
    assert row.state == "active" and WatchWindow.of(row.details) == WatchWindow(60.0, 0.0, False, 2)
    made.resume_watch()
    assert len(host.watched) == 2 and host.rollbacks == []  # nothing is pending any more


def test_nothing_is_resumed_for_a_model_that_is_not_serving_or_a_deployment_without_a_record(
        state: StateStore, tmp_path: Path) -> None:
    host = Host({"reason": "WATCH_FPS", "message": "slow"})
    old = watched_row(state, None, sha="b" * 64)  # a deployment from before the record: nothing to resume
    manager(state, host, tmp_path)[0].resume_watch()
    assert host.watched == [] and DeploymentStore(state).get(old.id).state == "active"
    dep = watched_row(state, WatchWindow(60.0, 30.0).details()["watch_window"], serving="c" * 64)
    manager(state, host, tmp_path)[0].resume_watch()  # the start serves another model: nothing of it to watch
    row = DeploymentStore(state).get(dep.id)
    assert host.watched == [] and host.rollbacks == [] and row.details["watch_window"]["pending"] is False


@pytest.mark.parametrize("case", ["unreadable record", "the watch fails"])
def test_a_watch_that_cannot_judge_rolls_back(state: StateStore, tmp_path: Path, case: str) -> None:
    record = {"window_s": 60.0, "remaining_s": "soon"} if case == "unreadable record" else \
        WatchWindow(60.0, 30.0).details()["watch_window"]
    dep = watched_row(state, record)
    host = Host(fails=True)
    made, events = manager(state, host, tmp_path)
    made.resume_watch()
    row = made.store.get(dep.id)
    assert host.rollbacks == ["watch"] and (row.state, row.reason) == ("rolled_back", "WATCH"), row
    assert "rolled back" in row.message and events[0][0] == "rolled_back"
