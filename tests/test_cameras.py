"""Many cameras in a real agent run: per-camera results and stats with the real demo model, one camera
failing while the others keep flowing, and a swap between two batches with no frame lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agent.config.tree import AgentConfig
from agent.daemon.runner import Agent
from agent.pipeline.live_view import status_line
from agent.cli.status import read_status, render_status
from tests.deploy_fixtures import agent_settings, make_artifact, make_key, wait_terminal
from tests.helpers import wait_for

pytestmark = pytest.mark.slow


def synthetic(name: str, seed: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "kind": "synthetic", "width": 160, "height": 120, "fps": 5, "seed": seed, **extra}


@pytest.fixture
def published(tmp_path: Path) -> dict[str, Any]:
    private, public = make_key(tmp_path / "keys")
    v1 = make_artifact(tmp_path / "pub" / "v1", "1.0.0", private)
    v2 = make_artifact(tmp_path / "pub" / "v2", "2.0.0", private)
    return {"public": public, "v1": v1, "url2": (v2 / "manifest.json").as_uri()}


@pytest.fixture
def start_agent(tmp_path: Path, published):
    agents: list[Agent] = []

    def start(cameras: list[dict[str, Any]], **overrides: Any) -> tuple[Agent, list[tuple], list[tuple]]:
        settings = agent_settings(tmp_path, published["public"], published["v1"], **overrides)
        settings.pop("camera")
        settings["cameras"] = cameras
        results: list[tuple] = []
        events: list[tuple] = []
        agent = Agent(AgentConfig(**settings), on_event=lambda type_, **f: events.append((type_, f)))
        agent.start()
        agents.append(agent)
        original = agent.worker.on_result

        def collect(frame, result, runtime) -> None:
            results.append((frame.source, frame.index, result))
            original(frame, result, runtime)

        agent.worker.on_result = collect
        return agent, results, events

    yield start
    for agent in agents:
        if agent.state != "stopped":
            agent.stop()


def per_camera(results: list[tuple], name: str) -> int:
    return sum(1 for camera, _, _ in results if camera == name)


def test_per_camera_results_and_stats_with_a_failing_camera(start_agent, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-video.mp4"
    cameras = [synthetic("left", 1), synthetic("right", 2),
               {"name": "door", "kind": "file", "path": str(missing), "reopen_initial_s": 0.05, "reopen_max_s": 0.2}]
    agent, results, events = start_agent(cameras, batch={"max_size": 3, "timeout_ms": 50})
    assert agent.batch_size.size == 3
    assert wait_for(lambda: per_camera(results, "left") >= 6 and per_camera(results, "right") >= 6, timeout=120), \
        "the live cameras stalled behind the failing one"
    lost = [f for t, f in events if t == "camera_lost"]
    assert lost and lost[0]["camera"] == "door" and lost[0]["code"] == "CAMERA_FAILED"
    assert str(missing) in lost[0]["reason"]
    assert agent.health() == "degraded"
    assert wait_for(lambda: agent.cameras.stats("door").reopen_attempts >= 3, timeout=30), "no reopen with backoff"
    # results carry their camera's name; every detection result came from the demo model on that camera
    assert {camera for camera, _, _ in results} == {"left", "right"}
    assert all(r.to_dict()["detections"] for _, _, r in results[:4]), "synthetic text was not detected"
    assert agent.last_result["camera"] in ("left", "right")
    # the engine was built for batches of 3 (engine side): frames of several cameras share one call
    assert agent.worker.batch.batched and agent.worker.batch.capacity == 3

    summary = agent.stop()
    cams = summary["cameras"]
    assert set(cams) == {"left", "right", "door"}
    for name in ("left", "right"):
        assert cams[name]["frames"] >= 6 and cams[name]["fps"] > 0 and cams[name]["latency_ms"]["p99"] > 0
        assert set(cams[name]) >= {"frames", "fps", "dropped_frames", "latency_ms"}
        capture = cams[name]["capture"]  # the synthetic camera reads eagerly: each grab is retrieved
        assert capture["grabbed"] == capture["decoded"] >= cams[name]["frames"] and capture["skipped"] == 0
    assert cams["door"]["frames"] == 0 and not cams["door"]["connected"] and cams["door"]["capture"]["losses"] == 1
    assert summary["frames"] == cams["left"]["frames"] + cams["right"]["frames"]
    assert summary["dropped_frames"] == sum(c["dropped_frames"] for c in cams.values())
    assert summary["batch"]["max_size"] == 3 and summary["batch"]["batches"] > 0

    status = read_status(agent.config)
    assert set(status["cameras"]) == {"left", "right", "door"}
    console = Console(record=True, width=200)
    render_status(status, console)
    text = console.export_text()
    assert "camera   door (down)" in text and "camera   left:" in text and "camera   right:" in text
    assert f"decoded {cams['left']['capture']['decoded']} of {cams['left']['capture']['grabbed']} grabs" in text
    line = status_line(summary)
    assert "door down" in line and "left " in line and "right " in line


def test_telemetry_and_prometheus_numbers_per_camera(start_agent) -> None:
    from agent.daemon.telemetry_loop import FramePathMeter

    agent, results, _ = start_agent([synthetic("a", 1), synthetic("b", 2)], batch={"max_size": 2, "timeout_ms": 50})
    meter = FramePathMeter(agent)
    assert wait_for(lambda: per_camera(results, "a") >= 3 and per_camera(results, "b") >= 3, timeout=120)
    sample = meter.sample()
    assert set(sample["cameras"]) == {"a", "b"}
    for cam in sample["cameras"].values():
        assert cam["frames"] >= 3 and cam["fps"] > 0 and "p99" in cam["latency_ms"]
        assert cam["capture"]["grabbed"] >= cam["capture"]["decoded"] >= cam["frames"]
    assert sum(c["frames"] for c in sample["cameras"].values()) <= sample["frames"]


def test_swap_and_rollback_between_two_batches_lose_no_frame(start_agent, published) -> None:
    """Mailboxes that hold a frame at the swap boundary (cameras faster than the engine, and the worker held
    there until they do): every frame a camera captured is served or counted as a drop, none vanishes."""
    fast = {"fps": 60, "width": 320, "height": 240}
    agent, _, _ = start_agent([synthetic("a", 1, **fast), synthetic("b", 2, **fast)],
                              batch={"max_size": 2, "timeout_ms": 100})
    seen: list[tuple[str, int, int]] = []  # (camera, frame index, id of the runtime that ran it)
    full_at_swap: list[bool] = []  # per camera, at each swap boundary: a frame waited in its mailbox
    original, take_pending = agent.worker.on_result, agent.worker._take_pending

    def record(frame, result, runtime) -> None:
        seen.append((frame.source, frame.index, id(runtime)))
        original(frame, result, runtime)

    def at_boundary() -> None:
        if agent.worker._pending is not None:
            # on a machine whose engine outruns the cameras the mailboxes are often empty here: hold the worker
            # at the boundary until the cameras have put a frame, so the swap always meets a full mailbox
            wait_for(lambda: all(agent.batcher.mailbox(n).peek() is not None for n in ("a", "b")), timeout=2)
            full_at_swap.extend(agent.batcher.mailbox(n).peek() is not None for n in ("a", "b"))
        take_pending()

    agent.worker.on_result, agent.worker._take_pending = record, at_boundary
    assert wait_for(lambda: len(seen) >= 4, timeout=120)
    old_runtime = id(agent.worker.runtime)
    reply = agent.manager.request(published["url2"], channel="local")
    assert wait_terminal(agent, reply["deployment_id"]) == "active"
    assert agent.active.source.manifest.version == "2.0.0"
    assert wait_for(lambda: all(agent.worker.camera_windows.of(n).frames >= 3 for n in ("a", "b")), timeout=60)
    new_runtime = id(agent.worker.runtime)
    assert agent.manager.request_rollback()["model"]["version"] == "1.0.0"  # instant: v1 is still loaded
    assert wait_for(lambda: all(agent.worker.camera_windows.of(n).frames >= 3 for n in ("a", "b")), timeout=60)
    agent.stop()
    assert agent.stats.errors == 0
    assert any(full_at_swap), "no mailbox held a frame at a swap: the test would not see one emptied there"
    for camera in ("a", "b"):
        mine = [(index, rt) for cam, index, rt in seen if cam == camera]
        runtimes = [rt for i, (_, rt) in enumerate(mine) if i == 0 or mine[i - 1][1] != rt]
        assert runtimes == [old_runtime, new_runtime, old_runtime], "old and new model interleaved"
        indices = [index for index, _ in mine]
        assert indices == sorted(set(indices)), f"camera {camera}: a frame served twice or out of order"
        mailbox, captured = agent.batcher.mailbox(camera), agent.cameras.stats(camera).frames
        served = agent.worker.cameras.of(camera).frames
        waiting = 1 if mailbox.peek() is not None else 0
        assert mailbox.delivered == served, (
            f"camera {camera}: {mailbox.delivered - served} frame(s) taken, never served"
        )
        assert captured == served + mailbox.dropped + waiting, \
            f"camera {camera}: {captured} captured, {served} served, {mailbox.dropped} dropped, {waiting} waiting"


def test_restart_pipeline_of_one_camera_leaves_the_others_and_inference_running(start_agent) -> None:
    """`restart_pipeline` with `camera`, through the agent's own command dispatcher: only that camera gets a
    fresh thread and source; the other camera's thread runs on and loses no frame; an unknown name is refused."""
    import json

    agent, results, events = start_agent([synthetic("a", 1, fps=20), synthetic("b", 2, fps=20)],
                                         batch={"max_size": 2, "timeout_ms": 50})

    def command(args: dict[str, Any], id_: str) -> dict[str, Any]:
        body = {"id": id_, "command": "restart_pipeline", "args": args}
        return agent.dispatcher.dispatch(json.dumps(body).encode(), channel="local")

    assert wait_for(lambda: per_camera(results, "a") >= 3 and per_camera(results, "b") >= 3, timeout=120)
    before, worker = dict(agent.cameras.threads), agent.worker
    reply = command({"camera": "nope"}, "r0")
    assert not reply["ok"] and reply["error"]["code"] == "INVALID_COMMAND"
    assert "'nope'" in reply["error"]["message"] and "a, b" in reply["error"]["message"]
    assert agent.cameras.threads == before  # nothing restarted

    reply = command({"camera": "a"}, "r1")
    assert reply["ok"] and reply["result"] == {"restarted": True, "cameras": ["a"]}, reply
    assert ("pipeline_restarted", {"cameras": ["a"]}) in events
    fresh = agent.cameras.threads["a"]
    assert fresh is not before["a"] and not before["a"].is_alive() and fresh.is_alive()
    assert fresh.source is not before["a"].source  # a fresh source, too
    assert agent.cameras.threads["b"] is before["b"] and before["b"].is_alive()
    assert agent.worker is worker and worker.is_alive()
    served = {n: per_camera(results, n) for n in ("a", "b")}
    assert wait_for(lambda: fresh.stats.frames >= 3 and per_camera(results, "a") >= served["a"] + 2
                    and per_camera(results, "b") >= served["b"] + 2, timeout=120), "a camera stalled after the restart"
    agent.stop()

    assert agent.stats.errors == 0
    b = agent.cameras.stats("b")
    assert b.losses == 0 and b.reopen_attempts == 1  # opened once, never restarted
    indices = [index for camera, index, _ in results if camera == "b"]
    assert indices == sorted(set(indices))
    mailbox, served_b = agent.batcher.mailbox("b"), agent.worker.cameras.of("b").frames
    waiting = 1 if mailbox.peek() is not None else 0
    assert mailbox.delivered == served_b and b.frames == served_b + mailbox.dropped + waiting, \
        f"camera b: {b.frames} captured, {served_b} served, {mailbox.dropped} dropped, {waiting} waiting"


def test_auto_batch_size_follows_the_engine_swapped_in(start_agent) -> None:
    """`max_size = "auto"` is re-resolved from each swapped-in engine's curve (deployments, rollbacks and adapt
    switches go through Agent.swap_model): a variant whose batches pay runs batches of 2, one whose do not runs 1."""
    from dataclasses import replace

    from engines.runtime.batching import pick_batch_size

    agent, results, _ = start_agent(
        [synthetic("a", 1), synthetic("b", 2)], batch={"max_size": "auto", "timeout_ms": 50}
    )
    budget = agent.active.source.manifest.gates.latency_budget_ms

    def with_curve(loaded, curve: dict[str, float]):
        report = {
            **loaded.provisioned.report,
            "batch": {**(loaded.provisioned.report.get("batch") or {}), "curve": curve},
        }
        return replace(loaded, provisioned=replace(loaded.provisioned, report=report))

    # per-frame ms: batching pays / does not. Two cameras at 5 fps demand 10 fps: batch 1 of `pays` (6.7 fps)
    # cannot serve them, so "auto" needs batch 2; batch 1 of `flat` (200 fps) serves them
    pays, flat = {"1": 150.0, "2": 5.0}, {"1": 5.0, "2": 12.0}
    assert (pick_batch_size(pays, budget, 2), pick_batch_size(flat, budget, 2)) == (2, 1)
    for curve, size in ((pays, 2), (flat, 1), (pays, 2)):
        agent.swap_model(with_curve(agent.active, curve))
        assert agent.batch_size.size == size and "auto" in agent.batch_size.reason
        assert agent.batcher.max_size == size and agent.worker.tuner is not None and agent.worker.tuner.size == size
        assert agent.worker.batch.max_size == 2  # slots for the largest size the live tuner may move to
        served = len(results)
        assert wait_for(lambda: len(results) >= served + 4, timeout=60), "no frames served after the swap"
    from agent.cli.status import render_batch_live
    from agent.daemon.telemetry_loop import FramePathMeter
    from rich.console import Console

    telemetry = FramePathMeter(agent).sample()["batch"]
    assert telemetry["max_size"] == 2 and set(telemetry["curve_ms"]) == {"1", "2"} and "reason" in telemetry
    console = Console(record=True, width=200)
    render_batch_live(agent.summary()["batch"], console)
    text = console.export_text()  # export clears the record
    assert "live curve 1:" in text and "max 2" in text
    summary = agent.stop()
    assert summary["batch"]["max_size"] == 2 and summary["errors"] == 0
    batch = summary["batch"]
    assert batch["live"]["mode"] == "live" and set(batch["live"]["curve"]) == {"1", "2"}  # the last model's curve
    profile = batch["profile"]  # where a batch's time went, per size run since the last swap
    assert profile and all(row["engine_ms"] > 0 and row["batches"] >= 1 for row in profile.values()), profile
    assert batch["preprocess"]  # serial, parallel or still measuring: always said


def test_mqtt_results_carry_the_camera_name_and_every_camera_gets_its_turn(start_agent, mqtt_broker,
                                                                           collector_factory) -> None:
    collector = collector_factory(mqtt_broker.url, ["edge/cams-01/#"])
    agent, _, _ = start_agent([synthetic("a", 1), synthetic("b", 2), synthetic("c", 3)],
                              device_id="cams-01", batch={"max_size": 3, "timeout_ms": 50},
                              mqtt={"url": mqtt_broker.url, "results_rate_hz": 2.0, "telemetry_interval_s": 1.0})
    # three cameras at 5 fps into a 2 Hz results limit: only a fair turn gets all three names out
    results = lambda: collector.payloads("edge/cams-01/results")  # noqa: E731 - a query the checks below call again as results arrive
    assert collector.wait_for(lambda _m: {r.get("camera") for r in results()} >= {"a", "b", "c"}, timeout=60), \
        [r.get("camera") for r in results()]
    assert all("frame" in r and "detections" in r for r in results())
    meta = collector.payloads("edge/cams-01/meta")[-1]
    assert [c["name"] for c in meta["cameras"]] == ["a", "b", "c"]
    with_cameras = lambda: [s for s in collector.payloads("edge/cams-01/telemetry") if s.get("cameras")]  # noqa: E731 - a query the checks below call again as samples arrive
    assert collector.wait_for(lambda _m: len(with_cameras()) >= 1, timeout=30)
    assert set(with_cameras()[-1]["cameras"]) == {"a", "b", "c"}


def test_edge_agent_run_with_two_cameras_writes_per_camera_summary(agent_env, tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    config = tmp_path / "agent.toml"
    config.write_text('[[cameras]]\nname = "left"\nfps = 4\nwidth = 320\nheight = 240\n\n'
                      '[[cameras]]\nname = "right"\nfps = 4\nwidth = 320\nheight = 240\nseed = 5\n\n'
                      '[batch]\nmax_size = 2\ntimeout_ms = 100\n')
    summary_path = tmp_path / "summary.json"
    result = subprocess.run([sys.executable, "-m", "agent.cli", "run", "--config", str(config), "--duration", "5",
                             "--summary-json", str(summary_path)], capture_output=True, text=True, timeout=300,
                            env=os.environ.copy())
    assert result.returncode == 0, result.stderr
    summary = json.loads(summary_path.read_text())
    assert set(summary["cameras"]) == {"left", "right"}
    for cam in summary["cameras"].values():
        assert cam["frames"] > 0 and cam["fps"] > 0 and cam["latency_ms"]["p50"] <= cam["latency_ms"]["p99"]
    assert summary["model"]["name"] == "demo-det" and summary["batch"]["max_size"] == 2
    assert "camera left" in result.stdout and "camera right" in result.stdout


def test_a_restart_flood_is_coalesced_and_status_fps_is_what_was_delivered(start_agent) -> None:
    """Issue 19: a `restart_pipeline` flood halted inference (about 0.2 real fps) while `status` showed 4.5 fps,
    an average since start. Restarts that arrive while one runs are answered by it; `status` fps counts the
    results of the last 5 s."""
    import threading

    from agent.daemon.control import AgentController

    agent, results, events = start_agent([synthetic("a", 1, fps=20)])
    assert wait_for(lambda: len(results) >= 5, timeout=120)
    replies: list[dict] = []
    threads = [threading.Thread(target=lambda: replies.append(agent.restart_capture(None))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(replies) == 8 and all(r["restarted"] for r in replies)
    ran = [f for t, f in events if t == "pipeline_restarted"]
    assert 1 <= len(ran) < 8 and sum(1 for r in replies if r.get("coalesced")) == 8 - len(ran)
    served = len(results)
    assert wait_for(lambda: len(results) >= served + 5, timeout=60), "inference stalled after the flood"

    agent.worker.pause()
    try:
        assert wait_for(lambda: agent.recent_fps(1.0) == 0.0, timeout=10)
        controller = AgentController(agent.control_parts)  # the commands' view of the running agent
        assert wait_for(lambda: controller.status()["fps"] == 0.0, timeout=10)  # nothing for 5 s
        status = controller.status()
        assert status["fps_since_start"] > 0 and agent.summary()["fps"] > 0  # the average still says frames flow
    finally:
        agent.worker.resume()
    assert wait_for(lambda: agent.recent_fps(1.0) > 0, timeout=30)
