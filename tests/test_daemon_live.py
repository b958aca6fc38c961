"""The live snapshot (agent.daemon.reporting) and what telemetry makes of it, each on its own: a stand-in for the
running agent is a `LiveSource` that returns snapshots, and the snapshot is taken over a real, unstarted frame path
with stand-ins for the parts made after it (`LiveParts`)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.config.tree import AgentConfig
from agent.daemon.frame_path import FramePath
from agent.daemon.reporting import LiveParts, LiveReport, LiveSnapshot
from agent.daemon.result_sinks import ResultSinks
from agent.daemon.telemetry_loop import FramePathMeter
from agent.daemon.tracking_host import IDLE
from agent.storage.health import StorageHealth

CAPTURE = {"grabbed": 30, "decoded": 20, "skipped": 10, "frames": 20, "losses": 0, "recoveries": 0, "bad_frames": 0}
QUIET = LiveSnapshot(
    ts=1000.0, monotonic=50.0, health="online", frames=0, fps=0.0, recent_fps=0.0, dropped_frames=0, errors=0,
    latency_ms={}, stages_ms={}, window_latency_ms={}, window_stages_ms={}, model={}, result_sink_errors={},
    camera={}, cameras={}, batch=None, batch_live=None, deployment=None, adapt=None, adapt_telemetry=None,
    live_frames=None, video=None, shadow=None, shadow_telemetry=None, tracking=None, tracking_telemetry=None,
    storage={"degraded": False, "failures": 0}, storage_failing=False, last_results=[], duration_s=0.0)


class Snapshots:
    """A LiveSource that hands out the snapshots it was given, in order."""

    def __init__(self, *snapshots: LiveSnapshot) -> None:
        self.left = list(snapshots)

    def live_snapshot(self) -> LiveSnapshot:
        return self.left.pop(0)


def camera(frames: int, dropped: int = 0) -> dict[str, Any]:
    return {"frames": frames, "fps": 0.0, "dropped_frames": dropped, "latency_ms": {"p50": 12.0}, "errors": 0,
            "connected": True, "capture": dict(CAPTURE)}


def test_telemetry_turns_cumulative_counts_into_the_interval_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.daemon.telemetry_loop.time.monotonic", lambda: 40.0)  # the meter starts at 40 s
    first = dataclasses.replace(QUIET, monotonic=50.0, frames=100, dropped_frames=3,
                                cameras={"a": camera(60), "b": camera(40, dropped=3)})
    second = dataclasses.replace(first, monotonic=55.0, frames=150, cameras={"a": camera(90), "b": camera(60, 3)})
    meter = FramePathMeter(Snapshots(first, second))
    one = meter.sample()
    assert (one["fps"], one["interval_s"], one["frames_in_interval"]) == (10.0, 10.0, 100)  # 100 frames in 10 s
    assert one["cameras"]["a"]["fps"] == 6.0 and one["cameras"]["b"]["fps"] == 4.0
    assert one["cameras"]["b"]["capture"] == {"grabbed": 30, "decoded": 20, "skipped": 10}  # the decode fields only
    two = meter.sample()
    assert (two["fps"], two["frames"], two["frames_in_interval"]) == (10.0, 150, 50)  # 50 more in 5 s
    assert two["cameras"]["a"]["fps"] == 6.0 and two["cameras"]["b"]["fps"] == 4.0


def test_telemetry_leaves_out_what_is_not_running() -> None:
    sample = FramePathMeter(Snapshots(QUIET)).sample()
    assert not {"storage", "cameras", "model", "batch", "shadow", "adapt", "tracking"} & set(sample)
    running = dataclasses.replace(QUIET, storage_failing=True, model={"name": "m"}, batch_live={"max_size": 2},
                                  shadow_telemetry={"frames": 4}, adapt_telemetry={"enabled": True},
                                  tracking_telemetry={"cameras": {}})
    sample = FramePathMeter(Snapshots(running)).sample()
    assert sample["storage"] == QUIET.storage and sample["model"] == {"name": "m"}
    assert sample["batch"] == {"max_size": 2} and sample["shadow"] == {"frames": 4}
    assert sample["adapt"] == {"enabled": True} and sample["tracking"] == {"cameras": {}}


def none() -> None:
    """A part that is not running."""


class Manager:
    def __init__(self, status: dict[str, Any] | None) -> None:
        self.value = status


def report_over(tmp_path: Path, manager: Manager) -> LiveReport:
    """A live report over a real frame path that has not started (no cameras, no worker yet)."""
    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    events: list[str] = []
    sinks = ResultSinks()
    path = FramePath(cfg, threading.Event(), lambda type_, **_: events.append(type_), sinks, lambda camera: None)
    storage = StorageHealth(lambda *a, **k: None, lambda: {}, lambda: 2**40, str(tmp_path))
    return LiveReport(path, storage, sinks, LiveParts(active=none, deployment=lambda: manager.value, adapt=none,
                                                      shadow=none, live_frames=none, video=none,
                                                      tracking=lambda: IDLE))


def test_the_snapshot_of_an_agent_before_its_frame_path_runs(tmp_path: Path) -> None:
    manager = Manager(None)
    snap = report_over(tmp_path, manager).live_snapshot()
    assert (snap.health, snap.frames, snap.dropped_frames, snap.model, snap.batch, snap.cameras) == \
        ("online", 0, 0, {}, None, {})
    assert snap.camera == dict.fromkeys(CAPTURE, 0)
    summary, record = snap.summary(), snap.live_record()
    assert summary["camera"] == snap.camera and summary["last_results"] == [] and summary["tracking"] is None
    assert record["state"] == "online" and record["deployment"] is None and record["storage"] == snap.storage
    manager.value = {"deployment_id": "d1", "watching": False}  # a deployment on its way: updating
    assert report_over(tmp_path, manager).live_snapshot().health == "updating"
    manager.value = {"deployment_id": "d1", "watching": True}  # under its watch: serving, online
    snap = report_over(tmp_path, manager).live_snapshot()
    assert snap.health == "online" and snap.live_record()["deployment"] == manager.value
