"""The whole agent with a model family on a real broker: the other variants build in the background,
`set_policy` over MQTT pins a variant (hot swap, an `adapt` event), changes are persisted, and status,
telemetry and the run summary show the active variant and the policy."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.adapt.controller import POLICY_KEY
from agent.deployments import watch as watch_module
from agent.telemetry import TelemetryCollector
from agent.cli.main import app as agent_app
from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from agent.storage.state import StateStore, state_db_path
from deploy.cli import app as deploy_app
from tests.deploy_fixtures import wait_terminal
from tests.helpers import wait_for
from tests.test_adapt_family import make_family

pytestmark = pytest.mark.slow


def family_config(tmp: Path, artifact: Path, public: Path, **extra) -> AgentConfig:
    return AgentConfig(
        device_id="fam-01", state_dir=tmp / "state", cache_dir=tmp / "cache",
        model={"path": artifact, "warmup_runs": 1}, camera={"kind": "synthetic", "width": 96, "height": 64, "fps": 20},
        artifacts={"trusted_keys": [str(public)]}, engines={"validation_samples": 2, "latency_runs": 3},
        deployments={"watch_window_s": 1.0, "watch_min_frames": 3}, **extra)


def send(broker, *args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(deploy_app, ["send", "fam-01", *args, "--broker", broker.url, "--timeout", "30"])
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else {}


def test_set_policy_over_a_real_broker(tmp_path: Path, mqtt_broker, collector_factory, monkeypatch) -> None:
    artifact, public = make_family(tmp_path, ["full:fp32", "int8:int8", "small:int8:16x16"])
    config = family_config(tmp_path, artifact, public, mqtt={"url": mqtt_broker.url, "telemetry_interval_s": 1.0},
                           adapt={"temp_limit_c": 90})
    collector = collector_factory(mqtt_broker.url, ["edge/fam-01/#"])
    agent = Agent(config)
    agent.start()
    try:
        assert agent.adapt is not None and wait_for(agent.adapt.built.is_set, timeout=120)
        events = lambda kind: [e for e in collector.payloads("edge/fam-01/events") if e["type"] == kind]  # noqa: E731 - a query the checks below call again as events arrive
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
        telemetry = lambda: [s for s in collector.payloads("edge/fam-01/telemetry")  # noqa: E731 - a query the checks below call again as samples arrive
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
    monkeypatch.setenv("EDGE_AGENT_STATE_DIR", str(config.state_dir))
    monkeypatch.setenv("EDGE_AGENT_CACHE_DIR", str(config.cache_dir))
    shown = CliRunner().invoke(agent_app, ["status"]).stdout
    assert "adapt    fam@1.0.0" in shown and "small int8 16x16 accuracy" in shown and "full fp32 32x32" in shown
    listed = json.loads(CliRunner().invoke(agent_app, ["engines", "list", "--json"]).stdout)
    variants = listed["family"]["variants"]
    assert [(v["name"], v["status"]) for v in variants] == [("full", "ready"), ("int8", "ready"), ("small", "ready")]
    assert all(v["accuracy"] is not None and v["latency_ms"]["p99"] > 0 for v in variants)
    assert {v["engine_key"] for v in variants} <= {e["key"][:12] for e in listed["engines"]}


def test_deployment_replaces_the_family_and_rollback_restores_it_at_its_variant(tmp_path: Path) -> None:
    v1, public = make_family(tmp_path, ["full:fp32", "int8:int8", "small:int8:16x16"])
    v2, _ = make_family(tmp_path, ["full:fp32", "tiny:int8:16x16"], version="2.0.0", out="v2")
    agent = Agent(family_config(tmp_path, v1, public))
    agent.start()
    try:
        assert wait_for(lambda: agent.adapt is not None and agent.adapt.built.is_set(), timeout=120)
        agent.adapt.set_policy({"pinned": "int8"})
        assert wait_for(lambda: agent.active.variant == "int8", timeout=30)
        v1_int8 = agent.active

        dep_id = agent.manager.request((v2 / "manifest.json").as_uri(), channel="local")["deployment_id"]
        assert wait_terminal(agent, dep_id) == "active"
        assert wait_for(lambda: agent.adapt is not None and agent.adapt.built.is_set(), timeout=120)
        assert agent.adapt.source.manifest.version == "2.0.0"
        assert [m.name for m in agent.adapt.members] == ["full", "tiny"]  # the whole family was replaced
        assert agent.previous is v1_int8  # kept loaded for rollback: the variant v1 was serving

        agent.manager.request_rollback()
        assert agent.active is v1_int8 and agent.worker.runtime is v1_int8.runtime
        assert agent.adapt.source.manifest.version == "1.0.0" and agent.adapt.active.name == "int8"
        frames = agent.stats.frames
        assert wait_for(lambda: agent.stats.frames > frames + 3, timeout=30)
    finally:
        summary = agent.stop()
    assert summary["errors"] == 0 and summary["model"]["variant"] == "int8"


def test_a_serving_model_outside_its_family_keeps_serving_alone(tmp_path: Path) -> None:
    """The manifest's own settings (fp32 32x32) match none of the declared variants: no adaptation, no crash."""
    artifact, public = make_family(tmp_path, ["half:int8", "small:int8:16x16"])
    events: list[tuple[str, dict]] = []
    agent = Agent(family_config(tmp_path, artifact, public), on_event=lambda t, **f: events.append((t, f)))
    agent.start()
    try:
        assert agent.adapt is None
        failed = [f for t, f in events if t == "adapt_family"]
        assert failed and failed[0]["state"] == "failed" and failed[0]["code"] == "ADAPT_NO_VARIANT"
        assert wait_for(lambda: agent.stats.frames >= 3, timeout=30)
    finally:
        agent.stop()


def overlaps(spans: list[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    return [(a, b) for a, b in spans if a < window[1] and b > window[0]]


def test_a_deployed_family_builds_and_switches_only_after_its_watch(tmp_path: Path, monkeypatch) -> None:
    """Variant builds would compete with the model being judged, a stored pin would swap variants (and
    reset `worker.window`, which the watch reads) during the watch: the new family waits for it to pass."""
    v1, public = make_family(tmp_path, ["full:fp32", "int8:int8"])
    v2, _ = make_family(tmp_path, ["full:fp32", "tiny:int8:16x16"], version="2.0.0", out="v2")
    config = family_config(tmp_path, v1, public)
    config.deployments.watch_window_s = 2.0
    events: list[tuple[float, str, dict]] = []
    agent = Agent(config, on_event=lambda t, **f: events.append((time.monotonic(), t, f)))
    agent.start()
    try:
        assert wait_for(lambda: agent.adapt is not None and agent.adapt.built.is_set(), timeout=120)
        agent.store.set_kv(POLICY_KEY, {"pinned": "tiny"})  # a stored pin only the new family can follow
        builds: list[tuple[float, float]] = []
        provision = agent.loader.provision

        def timed_provision(source, *args, **kwargs):
            started = time.monotonic()
            try:
                return provision(source, *args, **kwargs)
            finally:
                builds.append((started, time.monotonic()))

        watches: list[tuple[float, float, bool]] = []
        judge = watch_module.watch_model

        def timed_watch(worker, *args, **kwargs):
            started, window = time.monotonic(), worker.window
            try:
                return judge(worker, *args, **kwargs)
            finally:
                watches.append((started, time.monotonic(), worker.window is window))

        dep_id = agent.manager.request((v2 / "manifest.json").as_uri(), channel="local")["deployment_id"]
        monkeypatch.setattr(agent.loader, "provision", timed_provision)
        monkeypatch.setattr(watch_module, "watch_model", timed_watch)
        assert wait_terminal(agent, dep_id) == "active"
        switched = lambda: [f for _t, kind, f in events if kind == "adapt"]  # noqa: E731 - a query the checks below call again as events arrive
        assert wait_for(switched, timeout=120)  # the pin, once the watch released the family
        assert agent.active.variant == "tiny"
        assert len(watches) == 1
        started, ended, same_window = watches[0]
        assert same_window  # no swap reset what the watch was reading
        variant_builds = builds[1:]  # the first is the deployment's own engine, before its activation
        assert variant_builds and overlaps(variant_builds, (started, ended)) == []
        during = [(t, kind) for t, kind, f in events if started <= t <= ended and kind in ("adapt", "adapt_family")]
        assert during == []
        switch = switched()[-1]
        assert (switch["from"], switch["to"], switch["reason"], switch["model"]) == (
            "full",
            "tiny",
            "pinned",
            "fam@2.0.0",
        )
    finally:
        summary = agent.stop()
    assert summary["errors"] == 0


def test_a_restart_resumes_the_variant_it_served_last(tmp_path: Path, monkeypatch) -> None:
    """The variant persisted at each switch is read at the next start and switched to once built; the
    controller samples through the agent's one telemetry collector, and telemetry carries the policy state."""
    artifact, public = make_family(tmp_path, ["full:fp32", "int8:int8", "small:int8:16x16"])
    config = family_config(tmp_path, artifact, public)
    collectors: list[TelemetryCollector] = []
    init = TelemetryCollector.__init__

    def counted(self, *args, **kwargs) -> None:
        collectors.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(TelemetryCollector, "__init__", counted)
    agent = Agent(config)
    agent.start()
    try:
        assert wait_for(lambda: agent.adapt is not None and agent.adapt.built.is_set(), timeout=120)
        agent.adapt.set_policy({"pinned": "small"})
        assert wait_for(lambda: agent.active.variant == "small", timeout=30)
        agent.adapt.set_policy({"pinned": None, "enabled": False})  # frozen at small, not pinned
        assert collectors == [agent.plane.telemetry.collector]  # no second jtop/NVML client for the family
    finally:
        agent.stop()

    events: list[tuple[str, dict]] = []
    again = Agent(config, on_event=lambda t, **f: events.append((t, f)))
    again.start()
    try:
        assert wait_for(lambda: again.adapt is not None and again.adapt.built.is_set(), timeout=120)
        assert again.active.variant == "small" and again.worker.runtime is again.active.runtime
        assert [(f["from"], f["to"], f["reason"]) for t, f in events if t == "adapt"] == [("full", "small", "restored")]
        frames = again.stats.frames
        assert wait_for(lambda: again.stats.frames > frames + 3, timeout=30)
        sample = again.plane.telemetry.sample()
        assert sample["adapt"] == {"enabled": False, "pinned": None, "variant": "small"}
        assert sample["model"]["variant"] == "small"
        assert again.adapt.status()["frames_by_variant"].get("small", 0) > 0
    finally:
        summary = again.stop()
    assert summary["errors"] == 0 and summary["model"]["variant"] == "small"
