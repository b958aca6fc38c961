"""The deployment watch on a running agent over a real broker (issue 27): commands from `edge-deploy send`, a
real Mosquitto, artifacts from a real HTTP server, real ONNX Runtime models.

- A heavier model deployed over a lighter one is judged on its own capacity: the PP-OCRv4 detector at 960x704
  (~13-15 fps here) over the text-direction classifier (camera-bound, 30 fps) was rolled back in 8 of 8 tries
  by the old floor (0.5 x the classifier's 30 fps); 20 deployments in a row must now all pass the watch.
- A model that passes its gate but is slow on what the camera sees (tests/slow_model.py: fast on the gate's
  bright frames, slow on a camera replaying dark ones) is still rolled back, every time, with the numbers.
- An INT8 engine that passes its gate and is blind on live frames (issue 18) rolls back by itself:
  WATCH_OUTPUT_COLLAPSE against the previous model's detections on the same camera.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from agent.cli.status import read_status
from deploy.cli import app as deploy_app
from tests.deploy_fixtures import make_artifact, make_key
from tests.helpers import wait_for
from tests.http_server import ArtifactServer
from tests.slow_model import dark_frames, slow_on_dark_onnx, steps_for_ms
from tests.test_classifier_deploy import _package_classifier

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # windows of live frame rates: alone (make test)

DEVICE = "watch-01"
MIN_FRAMES = 10  # DeploymentConfig.watch_min_frames: a watch that passes on fewer has judged nothing


def send(broker, *args: str) -> dict:
    result = CliRunner().invoke(deploy_app, ["send", DEVICE, *args, "--broker", broker.url, "--timeout", "30"])
    reply = json.loads(result.stdout) if result.stdout.strip() else {}
    assert result.exit_code == 0 and reply.get("ok"), f"{args}: {result.output}"
    return reply["result"]


def outcome(collector, dep_id: str, timeout: float = 120.0) -> dict:
    """The deployment's end as the fleet sees it: its watch_passed or rolled_back event, or its failure."""
    def ends() -> list[dict]:
        return [e for e in collector.payloads(f"edge/{DEVICE}/events") if e.get("deployment_id") == dep_id and (
            e.get("type") in ("watch_passed", "rolled_back") or e.get("state") == "failed")]

    assert collector.wait_for(lambda _m: bool(ends()), timeout=timeout), f"deployment {dep_id} never ended"
    return ends()[0]


@pytest.fixture
def live_agent(tmp_path: Path, mqtt_broker, collector_factory):
    """start(bootstrap, camera, **deployments) -> (agent, collector, server); stopped at teardown."""
    started = []

    def start(bootstrap: Path, camera: dict, public: Path, **deployments) -> tuple[Agent, object, ArtifactServer]:
        settings = {
            "device_id": DEVICE, "state_dir": tmp_path / "state", "cache_dir": tmp_path / "cache",
            "model": {"path": bootstrap, "warmup_runs": 1}, "camera": camera,
            "artifacts": {"trusted_keys": [str(public)], "allow_http": True},
            "engines": {"validation_samples": 2, "latency_runs": 5},
            "mqtt": {"url": mqtt_broker.url, "telemetry_interval_s": 5.0},
            "deployments": {"max_requests_per_minute": 0, **deployments},
        }
        collector = collector_factory(mqtt_broker.url, [f"edge/{DEVICE}/events"])
        server = ArtifactServer(tmp_path / "pub").__enter__()
        agent = Agent(AgentConfig(**settings))
        started.append((agent, server))  # stopped at teardown even when start fails
        agent.start()
        assert wait_for(lambda: agent.stats.frames >= 3, timeout=60), "loop never produced frames"
        return agent, collector, server

    yield start
    for agent, server in started:
        agent.stop()
        server.__exit__(None, None, None)


def watch_window_for(watched: list[tuple[float, float]]) -> float:
    """A watch window that holds MIN_FRAMES frames three times over, from what the heavy model's last watches in this
    test saw on this machine ((fps, swap gap s) each): the window opens at the model's first result, so the gap
    comes first. 2.5 s on an idle 2-core machine (~13-15 fps, a gap of ~0.1 s), longer on a busy one, where a fixed
    2.5 s closed on 1 frame (two CPU hogs and a neighbour's tests), and twice the last rate once closed on 9 (the rate
    halved and the gap was 1.2 s). The first window, with nothing measured yet, is generous."""
    if not watched:
        return 20.0
    recent = watched[-3:]
    slowest, gap = min(fps for fps, _ in recent), max(gap for _, gap in recent)
    return min(30.0, max(2.5, gap + 3 * MIN_FRAMES / slowest))


def assert_own_floor(floor_from: dict, ratio: float) -> None:
    """Issue 27's point: the floor is `min_fps_ratio` x the new model's own expected rate (its gate-measured capacity,
    capped at the camera's 30 fps), never a share of the light model's 30 fps."""
    assert floor_from["source"] == "min_fps_ratio x expected" and floor_from["camera_fps"] == 30.0, floor_from
    expected = min(floor_from["capacity_fps"], floor_from["camera_fps"])
    assert floor_from["expected_fps"] == pytest.approx(expected, abs=0.02), floor_from
    assert floor_from["floor"] == pytest.approx(ratio * expected, abs=0.02) and expected < 30.0, floor_from


BUSY_RETRIES = 10  # rollbacks retried on a machine busy with other work (4 in 23 at load 7.5-10); an 11th fails


def busy_machine() -> bool:
    """More than twice as many runnable threads as cores over the last minute: other work than this test's (which
    keeps about 2-3 runnable on 2 cores by itself); two CPU hogs and a neighbour's tests made it 6-9."""
    return os.getloadavg()[0] > 2 * (os.cpu_count() or 1)


@pytest.mark.timeout(1200)  # 20 deployments whose windows stretch on a busy machine
def test_a_heavier_model_deployed_over_a_lighter_one_20_times_is_never_rolled_back(tmp_path: Path, mqtt_broker,
                                                                                    live_agent) -> None:
    """20 watches pass, each judged on >= 10 frames against a floor from the detector's own capacity (checked on
    every verdict: the old floor, half the classifier's 30 fps, rolled it back in 8 of 8 tries). The capacity is
    measured once, by the first build's gate; on a busy machine the load swings by more than 2x within seconds, and a
    window can then get under half of it (two CPU hogs and a neighbour's tests: 1.15 fps against 2.6 measured, 1.5
    against 3.82; 4 windows of 23 at a load average of 7.5-10 on 2 cores), a rollback the floor's rule makes right.
    So, while the machine is busy with other work (busy_machine), a WATCH_FPS rollback against the model's own floor
    is retried, at most 10 times; on an idle machine, or for any other rollback or floor, the test fails at once."""
    private, public = make_key(tmp_path / "keys")
    light = _package_classifier(tmp_path, private)
    make_artifact(tmp_path / "pub" / "det", "1.0.0", private, name="det", size=(960, 704), budget_ms=None)
    camera = {"kind": "synthetic", "width": 640, "height": 480, "fps": 30}
    agent, collector, server = live_agent(light, camera, public, watch_window_s=2.5, watch_min_s=2.0)
    url, ratio = server.url("det/manifest.json"), agent.config.deployments.min_fps_ratio
    passed: list[tuple[float, float]] = []  # (fps, swap gap s) of each passed watch
    retried: list[str] = []  # the rollbacks a busy machine explains
    for attempt in range(20 + BUSY_RETRIES):
        if len(passed) == 20:
            break
        agent.config.deployments.watch_window_s = watch_window_for(passed)
        dep_id = send(mqtt_broker, "deploy", "--arg", f"url={url}")["deployment_id"]
        end = outcome(collector, dep_id, timeout=180)
        if end["type"] != "watch_passed":
            load = os.getloadavg()[0]
            assert end["type"] == "rolled_back" and end["reason"] == "WATCH_FPS" and busy_machine(), \
                f"attempt {attempt} (load average {load}): {end}"
            assert_own_floor(end["floor_from"], ratio)
            retried.append(f"attempt {attempt}: {end['value']} fps < floor {end['limit']} at load average {load}")
            assert len(retried) <= BUSY_RETRIES, retried
            assert wait_for(lambda: agent.worker.window.frames >= 10, timeout=60)  # the light model serves again
            continue
        cam = end["cameras"]["cam0"]
        assert cam["frames"] >= MIN_FRAMES, f"attempt {attempt}: passed on too few frames to be judged: {end}"
        assert cam["fps"] >= cam["floor"] > 0
        assert_own_floor(cam["floor_from"], ratio)
        assert end["swap_gap_ms"] is not None and end["window_s"] >= 2.0
        passed.append((cam["fps"], end["swap_gap_ms"] / 1e3))
        # back by the local path (`edge-agent rollback`): over MQTT, rollback is limited to 10 a minute
        assert agent.manager.request_rollback()["model"]["name"] == "text-direction"
        assert wait_for(lambda: agent.worker.window.frames >= 10, timeout=60)  # the light model serves again
    assert len(passed) == 20, retried
    assert agent.stats.errors == 0


@pytest.mark.parametrize("case", ["latency", "fps"])
def test_a_model_slow_on_live_frames_is_rolled_back_every_time(tmp_path: Path, mqtt_broker, live_agent,
                                                               case: str) -> None:
    """The gate sees the fast path (well under 1 ms); the dark camera makes every frame slow: about 60 ms against
    a 20 ms budget (WATCH_LATENCY; fast enough that 10 frames come well inside the 2 s a starved camera is
    given), or, with no budget, about 1 fps against the floor of half the camera's 10 fps (WATCH_FPS). The steps
    are timed on this machine first: a fixed count was 50 ms on one and 170 ms (starved: WATCH_FPS) on another.
    On a busy machine that timing is itself off by 2-3x when the load changes (at 500 ms a frame, 2 fps, a run
    once came in at the floor): 1000 ms keeps the fps case 5x under it."""
    private, public = make_key(tmp_path / "keys")
    bootstrap = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)  # at 64x64 its gate finds no text
    dark_ms, budget = (60.0, 20.0) if case == "latency" else (1000.0, None)
    slow = slow_on_dark_onnx(tmp_path / "slow.onnx", steps_for_ms(tmp_path, dark_ms))
    make_artifact(tmp_path / "pub" / "slow", "1.0.0", private, name="slow", size=(64, 64), onnx=slow,
                  postprocess="raw", budget_ms=budget)
    camera = {"kind": "file", "path": str(dark_frames(tmp_path / "night")), "loop": True, "fps": 10}
    agent, collector, server = live_agent(bootstrap, camera, public, watch_window_s=30.0, watch_min_s=2.0)
    url = server.url("slow/manifest.json")
    for attempt in range(3):
        dep_id = send(mqtt_broker, "deploy", "--arg", f"url={url}")["deployment_id"]
        end = outcome(collector, dep_id)
        assert end["type"] == "rolled_back", f"attempt {attempt}: {end}"
        assert end["reason"] == f"WATCH_{case.upper()}" and end["camera"] == "cam0"
        assert end["value"] > end["limit"] if case == "latency" else end["value"] < end["limit"], end
        assert end["window_s"] >= 2.0 and end["restored"]["name"] == "demo-det" and end["swap_gap_ms"] > 0
        if case == "latency":  # about 10 fps (camera-bound), each frame about 60 ms: judged on >= 10 frames
            assert end["limit"] == 20.0 and end["statistic"].startswith("latency_p") and end["frames"] >= 10
        else:  # about 1 fps: held to its floor once 10 frames at the floor were due (2 s)
            assert end["statistic"] == "fps" and end["floor_from"]["camera_fps"] == 10.0 and end["limit"] == 5.0
        row = agent.deployments.get(dep_id)
        assert row.state == "rolled_back" and row.details["watch"]["limit"] == end["limit"]
        assert agent.active.source.manifest.name == "demo-det"
    # what `edge-agent status --json` prints, read from the state store while the daemon runs
    recent = read_status(agent.config)["recent_deployments"]
    assert [d["state"] for d in recent[:3]] == ["rolled_back"] * 3
    watch = recent[0]["details"]["watch"]
    assert {"limit", "value", "statistic", "window_s", "frames", "camera", "swap_gap_ms"} <= set(watch)


def test_a_blind_int8_engine_that_passed_its_gate_rolls_back_by_itself(tmp_path: Path, mqtt_broker,
                                                                      live_agent) -> None:
    """The demo detector as INT8 with `min_size` 500 px: its probability map agrees with FP32 on the gate's
    frames (mask IoU, text found: the gate passes), but every box is dropped, so on the live camera it finds
    nothing where the serving model found text lines in every frame."""
    private, public = make_key(tmp_path / "keys")
    bootstrap = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private, size=(320, 224))
    make_artifact(tmp_path / "pub" / "blind", "2.0.0", private, precision="int8", size=(320, 224),
                  params={"min_size": 500.0})  # at 160x128 the INT8 engine fails its gate (mask IoU 0.04)
    camera = {"kind": "synthetic", "width": 320, "height": 240, "fps": 10}
    agent, collector, server = live_agent(bootstrap, camera, public, watch_window_s=30.0, watch_min_s=2.0)
    assert wait_for(lambda: agent.output_health.numbers("cam0") and agent.output_health.numbers("cam0")["frames"] >= 30,
                    timeout=60), "the serving model has no history on cam0"
    assert agent.output_health.numbers("cam0")["detection_rate"] >= 0.9
    dep_id = send(mqtt_broker, "deploy", "--arg", f"url={server.url('blind/manifest.json')}")["deployment_id"]
    end = outcome(collector, dep_id, timeout=300)
    assert end["type"] == "rolled_back", end
    assert end["reason"] == "WATCH_OUTPUT_COLLAPSE" and end["camera"] == "cam0" and end["statistic"] == "detection_rate"
    assert end["value"] == 0.0 and end["before"]["detection_rate"] >= 0.9 and end["frames"] >= 10
    assert end["restored"]["version"] == "1.0.0" and agent.active.source.manifest.version == "1.0.0"
    row = agent.deployments.get(dep_id)
    assert row.state == "rolled_back" and row.reason == "WATCH_OUTPUT_COLLAPSE"
    verdict = row.details["watch"]
    assert verdict["limit"] == end["limit"] and "outputs collapsed" in row.message
