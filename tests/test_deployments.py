"""Deployments under a running loop: real artifacts, real engine builds and gates, real swaps.

Artifacts are published as file:// URLs, which only the local channel (the control socket) may deploy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from tests.deploy_fixtures import agent_settings, make_artifact, make_key, wait_terminal
from tests.helpers import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def published(tmp_path: Path):
    """A key pair, a bootstrap artifact (v1) and a candidate (v2) published as file:// URLs."""
    private, public = make_key(tmp_path / "keys")
    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)
    v2 = make_artifact(tmp_path / "pub" / "v2", "2.0.0", private)
    return {"private": private, "public": public, "v1": v1, "v2": v2, "url2": (v2 / "manifest.json").as_uri()}


@pytest.fixture
def running_agent(tmp_path: Path, published):
    agents = []

    def start(**overrides) -> Agent:
        agent = Agent(AgentConfig(**agent_settings(tmp_path, published["public"], published["v1"], **overrides)))
        agent.start()
        agents.append(agent)
        assert wait_for(lambda: agent.stats.frames >= 3, timeout=60), "loop never produced frames"
        return agent

    yield start
    for agent in agents:
        agent.stop()


@pytest.mark.serial  # counts frames lost across a swap: a neighbour's load drops frames
def test_overlap_swap_loses_no_frame_and_rollback_restores(running_agent, published) -> None:
    agent = running_agent()
    reply = agent.manager.request(published["url2"], channel="local")
    assert reply["accepted"] and not reply["joined"]
    assert agent.manager.request(published["url2"], channel="local")["joined"]  # same manifest: joins
    assert wait_terminal(agent, reply["deployment_id"]) == "active"
    dep = agent.deployments.get(reply["deployment_id"])
    states = [t["state"] for t in agent.deployments.transitions(dep.id)]
    assert states == ["requested", "fetching", "verifying", "building", "validating", "ready", "activating", "active"]
    assert agent.active.source.manifest.version == "2.0.0"
    assert wait_for(lambda: agent.worker.window.frames >= 3, timeout=60)
    assert agent.stats.errors == 0 and agent.batcher.dropped == 0, "a frame was lost across the swap"
    assert agent.previous is not None  # kept loaded for instant rollback
    assert agent.store.model_slot("active")["version"] == "2.0.0"

    result = agent.manager.request_rollback()
    assert result["model"]["version"] == "1.0.0"
    assert agent.active.source.manifest.version == "1.0.0"
    assert agent.deployments.get(dep.id).state == "rolled_back"
    assert agent.store.model_slot("active")["version"] == "1.0.0"
    frames = agent.stats.frames
    assert wait_for(lambda: agent.stats.frames > frames + 2, timeout=60)
    assert agent.stats.errors == 0


def test_stop_start_swap_reports_its_gap(running_agent, published) -> None:
    agent = running_agent(deployments={"swap_strategy": "stop_start"})
    dep_id = agent.manager.request(published["url2"], channel="local")["deployment_id"]
    assert wait_terminal(agent, dep_id) == "active"

    def swap_events() -> list:  # the row turns active a moment before the event is stored
        return [
            e for e in agent.store.events(50) if e["type"] == "deployment" and e["payload"].get("state") == "active"
        ]

    assert wait_for(lambda: swap_events(), timeout=30)
    swap = swap_events()
    assert swap[0]["payload"]["swap"]["strategy"] == "stop_start"
    assert swap[0]["payload"]["swap"]["gap_ms"] > 0
    assert agent.previous is None  # nothing kept: the device could not hold two


def test_candidate_failing_its_latency_gate_never_becomes_active(running_agent, published, tmp_path: Path) -> None:
    slow = make_artifact(tmp_path / "pub" / "slow", "3.0.0", published["private"], budget_ms=0.001)
    agent = running_agent()
    dep_id = agent.manager.request((slow / "manifest.json").as_uri(), channel="local")["deployment_id"]
    assert wait_terminal(agent, dep_id) == "failed"
    dep = agent.deployments.get(dep_id)
    assert dep.reason == "GATE_LATENCY"
    # refused here: its bytes are not kept (removed just after the failed state is written: state before side effects)
    assert dep.artifact_dir and wait_for(lambda: not Path(dep.artifact_dir).exists(), timeout=10)
    assert Path(agent.store.model_slot("active")["path"]).is_dir()
    assert wait_for(lambda: any(e["type"] == "artifact_collected" and e["payload"].get("reason") == "deployment failed"
                                for e in agent.store.events(50)), timeout=10)
    assert agent.active.source.manifest.version == "1.0.0"
    assert agent.store.model_slot("active")["version"] == "1.0.0"
    frames = agent.stats.frames
    assert wait_for(lambda: agent.stats.frames > frames, timeout=30), "old model stopped serving"


@pytest.mark.parametrize("where", ["config min_fps", "manifest gates.min_fps"])
def test_an_fps_floor_the_camera_cannot_reach_is_refused_before_activation(running_agent, published, tmp_path: Path,
                                                                           where: str) -> None:
    """A 5 fps camera under a 50 fps floor: no model can meet it, so the candidate never becomes active (it used
    to be activated and rolled back by the watch, issue 27); the reason carries the numbers."""
    url = published["url2"]
    if where.startswith("manifest"):
        floored = make_artifact(tmp_path / "pub" / "floored", "2.0.0", published["private"], min_fps=50.0)
        url = (floored / "manifest.json").as_uri()
        agent = running_agent(deployments={"watch_window_s": 60.0})
    else:
        agent = running_agent(deployments={"watch_window_s": 60.0, "min_fps": 50.0})
    dep_id = agent.manager.request(url, channel="local")["deployment_id"]
    assert wait_terminal(agent, dep_id, timeout=300) == "failed"
    dep = agent.deployments.get(dep_id)
    assert dep.reason == "GATE_FPS" and f"floor 50 ({where})" in dep.message and "delivers 5 fps" in dep.message
    assert agent.active.source.manifest.version == "1.0.0"
    assert agent.store.model_slot("active")["version"] == "1.0.0"
    states = [t["state"] for t in agent.deployments.transitions(dep_id)]
    assert "activating" not in states and states[-1] == "failed"


@pytest.mark.parametrize("tamper,code", [
    ("model_byte", "ARTIFACT_SHA256_MISMATCH"),
    ("manifest", "ARTIFACT_SIGNATURE_INVALID"),
    ("unsigned", "ARTIFACT_UNSIGNED"),
])
def test_refused_artifacts_keep_the_old_model(running_agent, published, tmp_path: Path, tamper: str, code: str) -> None:
    bad = make_artifact(tmp_path / "pub" / f"bad-{tamper}", "9.0.0", published["private"])
    if tamper == "model_byte":
        model = next(bad.glob("*.onnx"))
        data = bytearray(model.read_bytes())
        data[len(data) // 2] ^= 0xFF
        model.write_bytes(bytes(data))
    elif tamper == "manifest":
        manifest = bad / "manifest.json"
        manifest.write_text(manifest.read_text().replace('"9.0.0"', '"9.0.1"'))
    else:
        (bad / "manifest.json.sig").unlink()
    agent = running_agent()
    dep_id = agent.manager.request((bad / "manifest.json").as_uri(), channel="local")["deployment_id"]
    assert wait_terminal(agent, dep_id) == "failed"
    assert agent.deployments.get(dep_id).reason == code
    assert agent.active.source.manifest.version == "1.0.0"
    assert not list((agent.config.state_dir / "artifacts" / "deployed").glob("*")), \
        "a refused artifact was left in the artifacts directory"


def test_second_deployment_while_busy_is_refused(running_agent, published, tmp_path: Path) -> None:
    """BUSY while the first deployment runs; once its row says `active`, a request is not refused even though the
    worker still holds it for a moment (it waits for the worker to let go: a client that polled the row to `active`
    and deployed at once was told BUSY "retry when it is active", in tests/test_trust_fetch.py under load)."""
    import threading

    from agent.deployments.manager import BusyError

    other = make_artifact(tmp_path / "pub" / "v3", "3.0.0", published["private"])
    agent = running_agent()
    manager = agent.manager
    remember, held, release = manager._remember_version, threading.Event(), threading.Event()

    def held_after_active(dep):  # the row is active here; the worker lets go only after this returns
        remember(dep)
        held.set()
        release.wait(60)

    manager._remember_version = held_after_active
    first = manager.request(published["url2"], channel="local")["deployment_id"]
    with pytest.raises(BusyError) as info:
        manager.request((other / "manifest.json").as_uri(), channel="local")
    assert info.value.code == "BUSY"
    assert held.wait(180) and agent.deployments.get(first).state == "active"
    replies: list = []
    asking = threading.Thread(target=lambda: replies.append(
        manager.request((other / "manifest.json").as_uri(), channel="local")))
    asking.start()
    asking.join(0.5)
    assert asking.is_alive() and replies == [], "the request did not wait for the ended deployment's worker"
    release.set()
    asking.join(10)
    assert replies and replies[0]["accepted"] is True and replies[0]["joined"] is False
    assert wait_terminal(agent, replies[0]["deployment_id"]) == "active"


def _hold_at_gc(agent: Agent):
    """Hold the deployment thread in its engine GC (between `active` and the watch); count watches started."""
    import threading

    in_gc, release, watches = threading.Event(), threading.Event(), []
    swaps = agent.swaps
    assert swaps is not None
    collect, watch = swaps.collect_engines, swaps.watch

    def held_gc(*args, **kwargs):
        in_gc.set()
        release.wait(60)
        return collect(*args, **kwargs)

    swaps.collect_engines = held_gc
    swaps.watch = lambda *args, **kwargs: watches.append(args) or watch(*args, **kwargs)
    return in_gc, release, watches


def test_an_active_deployment_is_watched_from_activation_and_a_rollback_before_its_watch_ends_it(
        running_agent, published) -> None:
    """Between `active` and the watch the deployment thread collects artifacts and engines (seconds on a slow
    SD card). Before, `status` named no deployment then (`edge-agent deploy --wait` took the finished row for
    success) and an operator's rollback there was followed by a watch of the restored model; now the deployment
    is `watching` from activation and a rollback in that gap ends it: no watch starts."""
    agent = running_agent()
    in_gc, release, watches = _hold_at_gc(agent)
    dep_id = agent.manager.request(published["url2"], channel="local")["deployment_id"]
    try:
        assert in_gc.wait(180), "the deployment never reached its engine GC"
        status = agent.manager.status()
        assert status is not None and status["deployment_id"] == dep_id
        assert status["state"] == "active" and status["watching"] is True
        assert agent.manager.watched()["deployment_id"] == dep_id
        assert agent.manager.request_rollback()["model"]["version"] == "1.0.0"
    finally:
        release.set()
    assert wait_for(lambda: agent.manager.status() is None, timeout=30)
    assert agent.deployments.get(dep_id).state == "rolled_back"
    assert agent.deployments.get(dep_id).reason == "ROLLBACK_REQUESTED"
    assert watches == []  # the restored model was not watched under the rolled-back deployment's name
    assert agent.active.source.manifest.version == "1.0.0"


def test_a_rollback_that_fails_before_the_watch_leaves_the_new_model_watched(running_agent, published) -> None:
    from kernel.errors import EdgeError

    agent = running_agent()
    in_gc, release, watches = _hold_at_gc(agent)

    def failing_rollback(*args, **kwargs):
        raise EdgeError("the previous model's artifact is gone", code="ROLLBACK_FAILED")

    assert agent.swaps is not None
    agent.swaps.rollback = failing_rollback
    dep_id = agent.manager.request(published["url2"], channel="local")["deployment_id"]
    try:
        assert in_gc.wait(180), "the deployment never reached its engine GC"
        with pytest.raises(EdgeError):
            agent.manager.request_rollback()
        assert agent.manager.status()["watching"] is True  # still watched: nothing was rolled back
    finally:
        release.set()
    assert wait_for(lambda: agent.manager.status() is None, timeout=60)
    assert len(watches) == 1 and agent.deployments.get(dep_id).state == "active"
    assert agent.active.source.manifest.version == "2.0.0"
