"""Issue 12, trust items 6-7: what a device refuses, checked with real agents and real servers.

- 6: the on-device demo key never signs a deployment (it stays good for the local demo model);
- 7: no downgrade/replay of an older signed version; no plain http unless configured.
(Items 8-9, URL policy, fetch deadlines and ONNX external data: test_trust_fetch.py.)
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent.artifacts.config import ArtifactsConfig
from agent.artifacts.trust import demo_trust, deployment_trust, ensure_demo_key, verify_artifact
from agent.control.control_socket import send_command
from agent.deployments.versions import VersionMemory, is_older
from agent.storage.state import StateStore, state_db_path
from kernel.errors import EdgeError
from tests.deploy_fixtures import agent_settings, make_artifact, wait_terminal
from tests.helpers import wait_for
from tests.http_server import ArtifactServer
from tests.trust_fixtures import agent_starter, dispatch, key_pair, trust_settings


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    return key_pair(tmp_path)


@pytest.fixture
def start_agent() -> Iterator[Any]:
    with agent_starter() as start:
        yield start


# --- 6: the demo key ---------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_mode_agent_refuses_a_deployment_signed_with_its_own_demo_key(tmp_path: Path, keys, start_agent) -> None:
    settings = agent_settings(tmp_path, keys["public"], tmp_path / "unused", control={"socket": tmp_path / "ctl.sock"})
    settings["model"] = {"path": None, "warmup_runs": 1}  # demo mode, with a fleet key configured
    agent = start_agent(settings)
    assert agent.active is not None and agent.active.origin == "demo"
    demo_key = agent.config.state_dir / "keys" / "demo.key"
    forged = make_artifact(tmp_path / "pub" / "forged", "9.0.0", demo_key)

    reply = send_command(tmp_path / "ctl.sock", "deploy", {"url": (forged / "manifest.json").as_uri()})
    assert reply["ok"], reply
    dep_id = reply["result"]["deployment_id"]
    assert wait_terminal(agent, dep_id) == "failed"
    assert agent.deployments.get(dep_id).reason == "ARTIFACT_SIGNATURE_INVALID"
    assert "demo key" in agent.deployments.get(dep_id).message
    assert agent.active.origin == "demo" and agent.active.source.manifest.version == "1.0.0"
    frames = agent.stats.frames
    assert wait_for(lambda: agent.stats.frames > frames, timeout=60), "the demo model stopped serving"


def test_demo_key_is_refused_for_deployments_even_when_listed_or_unsigned_allowed(tmp_path: Path, keys) -> None:
    state = tmp_path / "state"
    private, public = ensure_demo_key(state)
    signed = make_artifact(tmp_path / "pub" / "demo-signed", "2.0.0", private)
    listed = deployment_trust(ArtifactsConfig(trusted_keys=[str(public), str(keys["public"])]), state)
    lax = deployment_trust(ArtifactsConfig(trusted_keys=[str(keys["public"])], allow_unsigned=True), state)
    for trust in (listed, lax):
        with pytest.raises(EdgeError) as info:
            verify_artifact(signed, trust, check_model=False)
        assert info.value.code == "ARTIFACT_SIGNATURE_INVALID"
    # the same artifact is fine for the local demo trust, and fleet-signed ones for the deployment trust
    assert verify_artifact(signed, demo_trust(ArtifactsConfig(), state), check_model=False).manifest.version == "2.0.0"
    fleet = make_artifact(tmp_path / "pub" / "fleet", "2.0.0", keys["private"])
    assert verify_artifact(fleet, listed, check_model=False).manifest.version == "2.0.0"
    with pytest.raises(EdgeError):  # and the demo trust accepts nothing but the demo key
        verify_artifact(fleet, demo_trust(ArtifactsConfig(trusted_keys=[str(keys["public"])]), state),
                        check_model=False)


# --- 7: downgrade and plain http -----------------------------------------------------------------


@pytest.mark.parametrize("older,newer", [
    ("1.9.0", "1.10.0"), ("1.0.0", "2.0.0"), ("2.0.0", "2.0.0.1"), ("v1", "v2"),
    ("2.0.0-rc1", "2.0.0"),  # the release after its canary rc
    ("v2.0", "v10.0"), ("2.0", "v10.0.0"),  # numbers, not text; a leading v stripped
    ("2.0.0-1", "2.0.0-rc1"), ("1.0.0-alpha", "1.0.0-alpha.1"), ("1.0.0-alpha.1", "1.0.0-alpha.beta"),
    ("1.0.0-beta.2", "1.0.0-beta.11"), ("1.0.0-rc.1+build.9", "1.0.0+build.1"),  # SemVer 2.0 section 11
])
def test_versions_follow_semver_precedence(older: str, newer: str) -> None:
    assert is_older(older, newer) and not is_older(newer, older) and not is_older(newer, newer)


def test_build_metadata_and_trailing_zeros_do_not_order() -> None:
    for a, b in (("1.0.0+build.1", "1.0.0+build.2"), ("2.0", "2.0.0"), ("v3", "3.0.0")):
        assert not is_older(a, b) and not is_older(b, a)


def test_a_canary_rc_then_its_release_then_a_replay_of_the_rc(tmp_path: Path) -> None:
    memory = VersionMemory(StateStore(state_db_path(tmp_path)))
    memory.record("det", "2.0.0-rc1")
    memory.check("det", "2.0.0", allow_downgrade=False)  # the real release after the canary
    memory.record("det", "2.0.0")
    for replay in ("2.0.0-rc1", "v2.0.0-rc.9"):
        with pytest.raises(EdgeError) as info:
            memory.check("det", replay, allow_downgrade=False)
        assert info.value.code == "ARTIFACT_DOWNGRADE"
    memory.record("det", "v10.0")
    with pytest.raises(EdgeError):
        memory.check("det", "v2.0", allow_downgrade=False)
    memory.state.close()


@pytest.mark.parametrize("version", ["latest", "2.0.0_rc1", "1.0.0-", "release-2"])
def test_a_version_that_cannot_be_ordered_is_refused_clearly(tmp_path: Path, version: str) -> None:
    memory = VersionMemory(StateStore(state_db_path(tmp_path)))
    for highest in (None, "1.0.0"):
        if highest:
            memory.record("det", highest)
        with pytest.raises(EdgeError) as info:
            memory.check("det", version, allow_downgrade=False)
        assert info.value.code == "ARTIFACT_VERSION_INVALID" and "SemVer" in str(info.value)
    memory.check("det", version, allow_downgrade=True)  # a deliberate, local deploy may still do it
    memory.record("det", version)
    assert memory.highest("det") == "1.0.0"
    memory.state.close()


def _manager(tmp_path: Path, store: StateStore, artifacts: ArtifactsConfig) -> Any:
    from agent.deployments.config import DeploymentConfig
    from agent.deployments.manager import DeploymentManager
    from agent.deployments.store import DeploymentStore

    return DeploymentManager(DeploymentStore(store), None, tmp_path / "artifacts", artifacts,
                             DeploymentConfig(), lambda *a, **f: None, threading.Event())


def test_the_memory_is_seeded_from_the_active_and_previous_models(tmp_path: Path) -> None:
    """An agent upgraded from one without model_versions (or started on a fresh database) refuses the
    first replay too: the active and previous models count as deployed."""
    store = StateStore(state_db_path(tmp_path))
    store.set_active_model("det", "3.0.0", "/models/det3", "aa" * 32, {"origin": "deployment"})
    store.set_active_model("det", "2.0.0", "/models/det2", "bb" * 32, {"origin": "rollback"})
    assert store.query("SELECT * FROM model_versions") == []
    manager = _manager(tmp_path, store, ArtifactsConfig())
    assert manager.versions.highest("det") == "3.0.0"
    with pytest.raises(EdgeError) as info:
        manager.versions.check("det", "2.5.0", allow_downgrade=False)
    assert info.value.code == "ARTIFACT_DOWNGRADE"
    store.close()


@pytest.mark.parametrize("channel,remote_allowed,honoured", [
    ("mqtt", False, False), ("mqtt", True, True), ("local", False, True)])
def test_allow_downgrade_counts_from_the_broker_only_when_configured(tmp_path: Path, keys, channel: str,
                                                                     remote_allowed: bool, honoured: bool) -> None:
    from agent.deployments.manager import RequestOptions

    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", keys["private"])
    store = StateStore(state_db_path(tmp_path))
    artifacts = ArtifactsConfig(trusted_keys=[str(keys["public"])], allow_http=True,
                                allow_remote_downgrade=remote_allowed)
    manager = _manager(tmp_path, store, artifacts)
    manager.versions.record("demo-det", "2.0.0")
    with ArtifactServer(v1.parent) as server:
        url = server.url("v1/manifest.json") if channel == "mqtt" else (v1 / "manifest.json").as_uri()
        dep = manager.store.create(url)
        options = RequestOptions(channel, allow_downgrade=True)
        if honoured:
            assert manager._fetch(dep, options).is_dir()
        else:
            with pytest.raises(EdgeError) as info:
                manager._fetch(dep, options)
            assert info.value.code == "ARTIFACT_DOWNGRADE"
            assert "only from the local control socket" in str(info.value)
            assert "allow_remote_downgrade" in str(info.value)
    store.close()


def test_highest_version_survives_a_restart_and_a_deliberate_downgrade(tmp_path: Path) -> None:
    store = StateStore(state_db_path(tmp_path))
    VersionMemory(store).record("det", "2.0.0")
    VersionMemory(store).record("det", "1.0.0")  # deployed with allow_downgrade: the high mark stays
    store.close()
    memory = VersionMemory(StateStore(state_db_path(tmp_path)))
    assert memory.highest("det") == "2.0.0" and memory.highest("other") is None
    with pytest.raises(EdgeError) as info:
        memory.check("det", "1.5.0", allow_downgrade=False)
    assert info.value.code == "ARTIFACT_DOWNGRADE"
    memory.check("det", "1.5.0", allow_downgrade=True)
    memory.check("det", "2.0.0", allow_downgrade=False)  # the same version again is a redeploy, not a downgrade
    memory.state.close()


@pytest.mark.slow
def test_older_signed_version_is_refused_unless_allow_downgrade(tmp_path: Path, keys, start_agent,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from agent.cli.main import app

    agent = start_agent(trust_settings(tmp_path, keys))
    v2 = make_artifact(tmp_path / "pub" / "v2", "2.0.0", keys["private"])
    first = agent.manager.request((v2 / "manifest.json").as_uri(), channel="local")["deployment_id"]
    assert wait_terminal(agent, first) == "active"
    old_url = (tmp_path / "pub" / "v1" / "manifest.json").as_uri()

    refused = send_command(tmp_path / "ctl.sock", "deploy", {"url": old_url})["result"]["deployment_id"]
    assert wait_terminal(agent, refused) == "failed"
    assert agent.deployments.get(refused).reason == "ARTIFACT_DOWNGRADE"
    deployed = agent.config.state_dir / "artifacts" / "deployed"
    assert not list(deployed.glob("demo-det-1.0.0-*")), "the old model was downloaded before the refusal"
    assert agent.active.source.manifest.version == "2.0.0"

    monkeypatch.setenv("EDGE_AGENT_CONTROL__SOCKET", str(tmp_path / "ctl.sock"))  # what the CLI talks to
    result = CliRunner().invoke(app, ["deploy", old_url, "--allow-downgrade", "--wait", "--timeout", "240"])
    assert result.exit_code == 0, result.output
    assert agent.active.source.manifest.version == "1.0.0"
    assert agent.manager.versions.highest("demo-det") == "2.0.0"
    assert agent.manager.request_rollback()["model"]["version"] == "2.0.0"  # rollback stays allowed

    plain = dispatch(agent, "deploy", {"url": "http://127.0.0.1:9/manifest.json"}, "plain-http")
    assert plain["ok"] is False and plain["error"]["code"] == "ARTIFACT_URL_REFUSED"
    assert "allow_http" in plain["error"]["message"]
