"""Issue #43 end to end: a whole agent with tracking on, on the bundled text detector and the synthetic camera (its
text lines sway 12 px left and right every 6 s, so they cross a line and enter a zone over and over), a real
Mosquitto, a real Prometheus endpoint, a real SQLite state store, and a real deployment for the hot swap.

Proved here: track ids in the MQTT results; zone and line events on the broker through the outbox (stamped with
its `seq`) and in the state store; the counts in telemetry and on /metrics; the `set_zones` command over MQTT
(a self-intersecting zone and a point outside the frame refused with their codes, rate-limited, persisted across a
restart, shown in `status`); `[mqtt] results = "tracks"` sending on track changes only; ids that survive a hot swap
and restart, said by a `tracks_reset`, when the camera restarts; the overlay's zone and line in a snapshot.

The composition root (agent/daemon/runner.py) starts the host, registers its sink first and stops it after the worker.
"""

from __future__ import annotations

import inspect
import json
import urllib.request
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from agent.sources.synthetic import SyntheticConfig, SyntheticScene
from agent.video.overlay import LINE_COLOR, ZONE_COLOR
from deploy.mqtt_ops import send_command
from tests.deploy_fixtures import agent_settings, make_artifact, make_key, wait_terminal
from tests.fixtures_mqtt import free_port
from tests.helpers import wait_for

pytestmark = [pytest.mark.slow]

CAMERA = {"kind": "synthetic", "width": 320, "height": 256, "fps": 8}


def text_centre_x() -> float:
    """Where the synthetic camera's first text line is centred at rest (it sways +-12 px around it)."""
    x1, _, x2, _ = SyntheticScene(SyntheticConfig(**CAMERA)).truth(0)[0].box
    return (x1 + x2) / 2


def tracking_config(**camera: Any) -> dict[str, Any]:
    x = round(text_centre_x())
    return {"enabled": True, "cameras": [{
        "camera": "cam0",
        "lines": [{"name": "post", "points": [[x, 0], [x, 255]]}],
        "zones": [{"name": "east", "polygon": [[x, 1], [318, 1], [318, 254], [x, 254]]}], **camera}]}


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory) -> Path:
    """One engine cache for this file's agents: the demo detector is built once."""
    return tmp_path_factory.mktemp("tracking-engines")


def started(cfg: AgentConfig) -> Agent:
    if "self.tracking.start(" not in inspect.getsource(Agent.start):  # fail at once, not after a minute of waiting
        pytest.fail("agent/daemon/runner.py does not start the tracking host yet")
    agent = Agent(cfg)
    agent.start()
    if not agent.tracking.active:
        agent.stop()
        pytest.fail("the agent did not start tracking: agent/daemon/runner.py lacks the tracking host's lines")
    return agent


def command(agent: Agent, name: str, args: dict, id_: str, channel: str = "mqtt") -> dict:
    """A command through the agent's own dispatcher (the same table, limits and replies MQTT uses)."""
    assert agent.dispatcher is not None
    return agent.dispatcher.dispatch(json.dumps({"id": id_, "command": name, "args": args}).encode(), channel)


def test_ids_events_counts_and_live_zones_on_a_real_broker(tmp_path: Path, engine_cache: Path, mqtt_broker,
                                                          collector_factory) -> None:
    port, url = free_port(), mqtt_broker.url
    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=engine_cache, device_id="trk-01", camera=CAMERA,
                      model={"warmup_runs": 1}, tracking=tracking_config(),
                      mqtt={"url": url, "results_rate_hz": 20, "telemetry_interval_s": 1},
                      telemetry={"prometheus_port": port})
    collector = collector_factory(url, ["edge/trk-01/#"])
    agent = started(cfg)
    try:
        # track ids in the results
        assert collector.wait_for(lambda _m: any(d.get("track_id") for r in collector.payloads("edge/trk-01/results")
                                                 for d in r.get("detections", [])), 60)
        result = next(r for r in reversed(collector.payloads("edge/trk-01/results")) if r["tracking"]["tracks"])
        assert result["tracking"]["track_epoch"] == 1 and {t["id"] for t in result["tracking"]["tracks"]} <= {
            1,
            2,
            3,
            4,
        }

        # zone and line events, through the outbox (its seq and boot id on each) and in the state store
        def tracking_events() -> list[dict]:
            return [e for e in collector.payloads("edge/trk-01/events") if e["type"] in ("zone_enter", "line_cross")]
        assert collector.wait_for(lambda _m: {"zone_enter", "line_cross"} <= {e["type"] for e in tracking_events()}, 60)
        crossing = next(e for e in tracking_events() if e["type"] == "line_cross")
        assert crossing["camera"] == "cam0" and crossing["line"] == "post" and crossing["direction"] in ("in", "out")
        assert crossing["track_epoch"] == 1 and crossing["class"] == "object" and "seq" in crossing
        assert "boot_id" in crossing and crossing["track_id"] in (1, 2, 3, 4)
        assert wait_for(lambda: {"zone_enter", "line_cross"} <= {e["type"] for e in agent.store.events(500)}, 10)

        # counted in telemetry and on the Prometheus endpoint
        assert collector.wait_for(lambda _m: any(s.get("tracking", {}).get("events", {}).get("line_cross")
                                                 for s in collector.payloads("edge/trk-01/telemetry")), 30)
        def scrape() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

        line_series = 'edge_agent_tracking_line_crossings{camera="cam0",class="object"'
        assert wait_for(lambda: line_series in scrape(), 30)  # the exporter's sample may be a beat behind telemetry
        metrics = scrape()
        assert 'edge_agent_tracking_zone_objects{camera="cam0",class="object",count="entered",zone="east"}' in metrics
        assert 'edge_agent_tracking_events{type="line_cross"}' in metrics

        # the overlay: the zone and the line on a snapshot of the camera
        picture = cv2.imdecode(np.frombuffer(agent.video.snapshots.take("cam0", True).jpeg, np.uint8), cv2.IMREAD_COLOR)
        x = round(text_centre_x())
        assert np.abs(picture[128, 318].astype(int) - ZONE_COLOR).max() <= 70  # the zone's right edge
        assert np.abs(picture[70, x].astype(int) - LINE_COLOR).max() <= 70  # the line (over the zone's left edge)

        # live zones over MQTT: refused with codes, applied, rate-limited, shown in status
        bow_tie = {"camera": "cam0", "zones": [{"name": "bad", "polygon": [[0, 0], [50, 50], [50, 0], [0, 50]]}]}
        reply = send_command(url, "trk-01", "set_zones", bow_tie, timeout_s=30)
        assert reply["error"]["code"] == "TRACKING_ZONE_SELF_INTERSECTING", reply
        outside = {"camera": "cam0", "lines": [{"name": "far", "points": [[10, 10], [400, 10]]}]}
        assert (
            send_command(url, "trk-01", "set_zones", outside, timeout_s=30)["error"]["code"] == "TRACKING_OUTSIDE_FRAME"
        )
        west = {"camera": "cam0", "zones": [{"name": "west", "coords": "normalized",
                                             "polygon": [[0.0, 0.0], [0.5, 0.0], [0.5, 1.0], [0.0, 1.0]]}]}
        reply = send_command(url, "trk-01", "set_zones", west, timeout_s=30)
        assert reply["ok"] and reply["result"]["zones"] == ["west"] and reply["result"]["persisted"], reply
        assert collector.wait_for(lambda _m: any(e["type"] == "zones_changed"
                                                 for e in collector.payloads("edge/trk-01/events")), 30)
        for i in range(29):  # 30 a minute on the mqtt channel; the refusals above cost no token
            assert command(agent, "set_zones", west, f"again-{i}")["ok"]
        assert send_command(url, "trk-01", "set_zones", west, timeout_s=30)["error"]["code"] == "RATE_LIMITED"
        status = send_command(url, "trk-01", "status", {}, timeout_s=30)["result"]["tracking"]["cameras"]["cam0"]
        assert status["shapes"]["source"] == "live" and [z["name"] for z in status["shapes"]["zones"]] == ["west"]
        assert status["track_epoch"] == 1 and set(status["zones"]) == {"west"}  # east's counts went with it
        assert status["lines"]["post"]["in"] or status["lines"]["post"]["out"]  # the line kept its counts
    finally:
        summary = agent.stop()
    assert summary["tracking"]["cameras"]["cam0"]["lines"]["post"]["in"] or \
        summary["tracking"]["cameras"]["cam0"]["lines"]["post"]["out"]

    # persisted across a restart: the next run has the zones set live
    again = started(cfg.model_copy(update={"mqtt": cfg.mqtt.model_copy(update={"url": ""}),
                                           "telemetry": cfg.telemetry.model_copy(update={"prometheus_port": 0})}))
    try:
        status = command(again, "status", {}, "status-after", "local")["result"]["tracking"]["cameras"]["cam0"]
        assert status["shapes"]["source"] == "live" and [z["name"] for z in status["shapes"]["zones"]] == ["west"]
    finally:
        again.stop()


def test_results_tracks_sends_on_track_changes_and_a_camera_restart_starts_new_ids(
        tmp_path: Path, engine_cache: Path, mqtt_broker, collector_factory) -> None:
    url = mqtt_broker.url
    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=engine_cache, device_id="trk-02",
                      camera={**CAMERA, "motion": False}, model={"warmup_runs": 1}, tracking={"enabled": True},
                      mqtt={"url": url, "results": "tracks", "results_rate_hz": 50})
    collector = collector_factory(url, ["edge/trk-02/#"])
    agent = started(cfg)
    try:
        assert wait_for(lambda: agent.stats.frames >= 40, 90)  # a still scene: the tracks were confirmed long ago
        results = collector.payloads("edge/trk-02/results")
        assert 1 <= len(results) <= 4 and results[-1]["tracking"]["tracks"], results
        assert {t["id"] for t in results[-1]["tracking"]["tracks"]} == {1, 2, 3, 4}
        reply = send_command(url, "trk-02", "restart_pipeline", {}, timeout_s=30)
        assert reply["ok"], reply
        assert collector.wait_for(lambda _m: any(e["type"] == "tracks_reset"
                                                 for e in collector.payloads("edge/trk-02/events")), 30)
        reset = next(e for e in collector.payloads("edge/trk-02/events") if e["type"] == "tracks_reset")
        assert reset["track_epoch"] == 2 and reset["reason"] == "camera_restarted" and reset["ended_tracks"] == 4
        assert collector.wait_for(lambda _m: any(r["tracking"]["track_epoch"] == 2 and r["tracking"]["tracks"]
                                                 for r in collector.payloads("edge/trk-02/results")), 30)
        after = next(r for r in collector.payloads("edge/trk-02/results") if r["tracking"]["track_epoch"] == 2
                     and r["tracking"]["tracks"])
        assert {t["id"] for t in after["tracking"]["tracks"]} <= {1, 2, 3, 4}  # ids start again at 1
        assert len(collector.payloads("edge/trk-02/results")) < agent.stats.frames / 4
    finally:
        agent.stop()


def test_track_ids_survive_a_hot_swap_of_the_detector(tmp_path: Path) -> None:
    private, public = make_key(tmp_path / "keys")
    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private, size=(320, 256))
    v2 = make_artifact(tmp_path / "pub" / "v2", "2.0.0", private, size=(256, 192))  # other input, other boxes
    cfg = AgentConfig(**agent_settings(tmp_path, public, v1, camera=CAMERA, tracking={"enabled": True}))
    agent = started(cfg)
    seen: list[tuple[str, int, frozenset[int]]] = []
    # after the tracking sink (it registered at start): what each frame's tracks were, and which model served it
    agent.result_sinks.add("test", lambda frame, result, runtime: seen.append(
        (runtime.source.manifest.version, agent.tracking.of(frame).epoch,
         frozenset(i for i in agent.tracking.of(frame).detection_ids if i is not None))))
    try:
        assert wait_for(lambda: len(seen) >= 10 and seen[-1][2] == {1, 2, 3, 4}, 60), seen[-5:]
        reply = command(agent, "deploy", {"url": (v2 / "manifest.json").as_uri()}, "swap", "local")
        assert reply["ok"], reply
        assert wait_terminal(agent, reply["result"]["deployment_id"]) == "active"
        assert wait_for(lambda: sum(1 for v, _, _ in seen if v == "2.0.0") >= 10, 60)
    finally:
        agent.stop()
    before = [ids for version, _, ids in seen if version == "1.0.0"][-3:]
    after = [ids for version, _, ids in seen if version == "2.0.0"][:10]
    assert before == [{1, 2, 3, 4}] * 3 and {1, 2, 3, 4} in after, (before, after)
    assert all(ids <= {1, 2, 3, 4} for ids in after) and {epoch for _, epoch, _ in seen} == {1}
