"""The whole agent on a real broker: retained status, telemetry, events, and every command from the operator CLI.

This is the path a fleet engineer uses: `edge-deploy send DEVICE COMMAND --broker URL` against a running
agent, a real Mosquitto in between, a real deployment behind `deploy`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from deploy.cli import app as deploy_app
from tests.deploy_fixtures import agent_settings, make_artifact, make_key, wait_terminal
from tests.helpers import wait_for
from tests.http_server import ArtifactServer

pytestmark = pytest.mark.slow


@pytest.fixture
def live(tmp_path: Path, mqtt_broker, collector_factory):
    private, public = make_key(tmp_path / "keys")
    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)
    v2 = make_artifact(tmp_path / "pub" / "v2", "2.0.0", private)
    settings = agent_settings(tmp_path, public, v1, device_id="cam-01",
                              mqtt={"url": mqtt_broker.url, "telemetry_interval_s": 1.0},
                              artifacts={"allow_http": True})  # remote deploys need http(s); file:// is local only
    collector = collector_factory(mqtt_broker.url, ["edge/cam-01/#"])
    agent = Agent(AgentConfig(**settings))
    with ArtifactServer(tmp_path / "pub") as server:
        agent.start()
        yield {"agent": agent, "collector": collector, "broker": mqtt_broker, "url2": server.url("v2/manifest.json"),
               "file2": (v2 / "manifest.json").as_uri()}
        agent.stop()


def send(broker, *args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(deploy_app, ["send", "cam-01", *args, "--broker", broker.url, "--timeout", "30"])
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else {}


def test_status_telemetry_and_commands_over_a_real_broker(live) -> None:
    agent, collector, broker = live["agent"], live["collector"], live["broker"]
    assert collector.wait_for(lambda msgs: any(t.endswith("/status") for t, _, _ in msgs), timeout=30)
    assert collector.payloads("edge/cam-01/status")[-1]["state"] in ("online", "updating")
    assert collector.wait_for(lambda msgs: any(t.endswith("/meta") for t, _, _ in msgs), timeout=30)
    meta = collector.payloads("edge/cam-01/meta")[-1]
    assert meta["fingerprint"]["onnxruntime"]

    assert wait_for(lambda: agent.stats.frames >= 3, timeout=60)
    with_model = lambda: [s for s in collector.payloads("edge/cam-01/telemetry") if "model" in s and s["frames"]]  # noqa: E731 - a query the checks below call again as samples arrive
    assert collector.wait_for(lambda _msgs: len(with_model()) >= 1, timeout=30)
    sample = with_model()[-1]
    assert sample["device_id"] == "cam-01" and sample["model"]["version"] == "1.0.0"
    assert "cpu_util" in sample and "mem_mb" in sample and "seq" in sample and "boot_id" in sample
    assert "power_mw" not in sample  # not a Jetson: absent, never zero

    code, reply = send(broker, "ping")
    assert code == 0 and reply["ok"] and reply["result"]["pong"]
    code, reply = send(broker, "status")
    assert code == 0 and reply["result"]["model"]["version"] == "1.0.0"
    code, reply = send(broker, "set_config", "--arg", "telemetry_interval_s=2", "--arg", "log_level=DEBUG")
    assert code == 0 and reply["result"]["applied"] == {"log_level": "DEBUG", "telemetry_interval_s": 2}
    assert agent.store.get_kv("live_config")["telemetry_interval_s"] == 2
    code, reply = send(broker, "engines")
    assert code == 0 and reply["result"]["engines"]
    code, reply = send(broker, "frobnicate")
    assert code == 1 and reply["error"]["code"] == "UNKNOWN_COMMAND"
    code, reply = send(broker, "set_config", "--arg", "telemetry_interval_s=-1")
    assert code == 1 and reply["error"]["code"] == "INVALID_COMMAND"
    assert agent.worker.is_alive() and agent.stats.errors == 0


def test_deploy_over_mqtt_reports_progress_as_events(live) -> None:
    agent, collector, broker = live["agent"], live["collector"], live["broker"]

    def meta_serves(version: str) -> bool:
        """The retained meta's `engine` and status's `model` name the serving model (meta's was null for a whole
        run before; status kept the old model until the health changed)."""
        metas, statuses = collector.payloads("edge/cam-01/meta"), collector.payloads("edge/cam-01/status")
        return bool(metas and statuses) and (metas[-1].get("engine") or {}).get("version") == version \
            and (statuses[-1].get("model") or {}).get("version") == version

    assert collector.wait_for(lambda _msgs: meta_serves("1.0.0"), timeout=30), collector.payloads("edge/cam-01/meta")
    code, reply = send(broker, "deploy", "--arg", f"url={live['file2']}")
    assert code == 1 and reply["error"]["code"] == "ARTIFACT_URL_REFUSED"  # file:// never from a remote command
    code, reply = send(broker, "deploy", "--arg", f"url={live['url2']}")
    assert code == 0 and reply["result"]["accepted"]
    dep_id = reply["result"]["deployment_id"]
    assert wait_terminal(agent, dep_id) == "active"
    assert collector.wait_for(lambda msgs: any(
        t.endswith("/events") and json.loads(p).get("state") == "active" for t, p, _ in msgs), timeout=30)
    states = [e["state"] for e in collector.payloads("edge/cam-01/events")
              if e.get("type") == "deployment" and e.get("deployment_id") == dep_id]
    assert states[:2] == ["requested", "fetching"] and states[-1] == "active"
    assert collector.wait_for(lambda _msgs: meta_serves("2.0.0"), timeout=30)
    code, reply = send(broker, "rollback")
    assert code == 0 and reply["result"]["model"]["version"] == "1.0.0"
    assert collector.wait_for(lambda _msgs: meta_serves("1.0.0"), timeout=30)
    code, reply = send(broker, "restart_pipeline")
    assert code == 0 and reply["result"] == {"restarted": True, "cameras": ["cam0"]}
    frames = agent.stats.frames
    assert wait_for(lambda: agent.stats.frames > frames, timeout=60), "no frames after restart_pipeline"
    code, reply = send(broker, "restart_pipeline", "--arg", "camera=door")
    assert code == 1 and reply["error"]["code"] == "INVALID_COMMAND" and "cam0" in reply["error"]["message"]
    code, reply = send(broker, "restart_pipeline", "--arg", "camera=cam0")
    assert code == 0 and reply["result"] == {"restarted": True, "cameras": ["cam0"]}
    frames = agent.stats.frames
    assert wait_for(lambda: agent.stats.frames > frames, timeout=60), "no frames after restarting camera cam0"
