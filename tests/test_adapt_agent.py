"""The whole agent with a model family on a real broker: the other variants build in the background,
`set_policy` over MQTT pins a variant (hot swap, an `adapt` event), changes are persisted, and status,
telemetry and the run summary show the active variant and the policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.adapt.controller import POLICY_KEY
from agent.config import AgentConfig
from agent.runner import Agent
from agent.state import StateStore, state_db_path
from deploy.cli import app as deploy_app
from tests.helpers import wait_for
from tests.test_adapt_family import make_family

pytestmark = pytest.mark.slow


def send(broker, *args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(deploy_app, ["send", "fam-01", *args, "--broker", broker.url, "--timeout", "30"])
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else {}


def test_set_policy_over_a_real_broker(tmp_path: Path, mqtt_broker, collector_factory) -> None:
    artifact, public = make_family(tmp_path, ["full:fp32", "int8:int8", "small:int8:16x16"])
    config = AgentConfig(
        device_id="fam-01", state_dir=tmp_path / "state", cache_dir=tmp_path / "cache",
        model={"path": artifact, "warmup_runs": 1}, camera={"kind": "synthetic", "width": 96, "height": 64, "fps": 20},
        artifacts={"trusted_keys": [str(public)]}, engines={"validation_samples": 2, "latency_runs": 3},
        mqtt={"url": mqtt_broker.url, "telemetry_interval_s": 1.0}, adapt={"temp_limit_c": 90})
    collector = collector_factory(mqtt_broker.url, ["edge/fam-01/#"])
    agent = Agent(config)
    agent.start()
    try:
        assert agent.adapt is not None and wait_for(agent.adapt.built.is_set, timeout=120)
        events = lambda kind: [e for e in collector.payloads("edge/fam-01/events") if e["type"] == kind]  # noqa: E731
        assert collector.wait_for(lambda _m: events("adapt_family"), timeout=30)
        family = events("adapt_family")[-1]["variants"]
        assert [(v["name"], v["status"]) for v in family] == [("full", "ready"), ("int8", "ready"), ("small", "ready")]

        code, reply = send(mqtt_broker, "set_policy", "--arg", "pinned=small", "--arg", "cooldown_s=5")
        assert code == 0 and reply["ok"], reply
        assert reply["result"]["policy"]["pinned"] == "small"
        assert collector.wait_for(lambda _m: events("adapt"), timeout=30)
        switch = events("adapt")[-1]
        assert (switch["from"], switch["to"], switch["reason"]) == ("full", "small", "pinned")
        assert agent.active.variant == "small" and agent.worker.runtime is agent.active.runtime
        frames = agent.stats.frames
        assert wait_for(lambda: agent.stats.frames > frames + 3, timeout=30)  # serving on the small variant

        code, reply = send(mqtt_broker, "set_policy", "--arg", "pinned=huge")
        assert code != 0 and reply["error"]["code"] == "INVALID_POLICY" and "full" in reply["error"]["message"]
        code, reply = send(mqtt_broker, "status")
        assert reply["result"]["adapt"]["active_variant"] == "small"
        assert reply["result"]["model"]["variant"] == "small"
        telemetry = lambda: [s for s in collector.payloads("edge/fam-01/telemetry")  # noqa: E731
                             if s.get("model", {}).get("variant") == "small"]
        assert collector.wait_for(lambda _m: telemetry(), timeout=30)
    finally:
        summary = agent.stop()
    assert summary["adapt"]["active_variant"] == "small"
    assert summary["adapt"]["frames_by_variant"]["small"] > 0 and summary["errors"] == 0
    store = StateStore(state_db_path(config.state_dir))
    try:
        assert store.get_kv(POLICY_KEY) == {"pinned": "small", "cooldown_s": 5.0}
        assert [v["name"] for v in store.get_kv("adapt_family")["variants"]] == ["full", "int8", "small"]
    finally:
        store.close()
