"""The agent-facing side of issue #43: the result sink over all cameras (per-model parameters, a model that is not
tracked, ids across a model swap, camera restarts), config resolution, and the thread that emits events."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from agent.sources.base import Frame
from agent.tracking import (EventForwarder, TrackEvent, Tracking, TrackingConfig, add_tracking, build_tracking,
                            tracked_of)
from agent.tracking.types import LINE_CROSS, TRACKS_RESET
from engines.postprocess.base import Detection, InferenceResult

IMAGE = np.zeros((480, 640, 3), np.uint8)


def runtime(name: str) -> SimpleNamespace:
    """The part of a ModelRuntime the sink reads: its manifest's name."""
    return SimpleNamespace(source=SimpleNamespace(manifest=SimpleNamespace(name=name)))


def frame(camera: str, index: int) -> Frame:
    return Frame(IMAGE, index, index / 30, camera)


def result(x: float) -> InferenceResult:
    return InferenceResult("detection", detections=[Detection((x, 200, x + 40, 280), 0.9, 0, "person")])


CONFIG = {
    "enabled": True,
    "tracker": {"max_age": 20},
    "models": {"detector-int8": {"max_age": 40}, "classifier": {"enabled": False}},
    "cameras": [{"camera": "cam0", "tracker": {"min_hits": 3},
                 "lines": [{"name": "door", "points": [[300, 0], [300, 480]]}]},
                {"camera": "cam1", "tracker": {"enabled": False}}],
}


def test_parameters_merge_defaults_tracker_model_camera() -> None:
    config = TrackingConfig.model_validate(CONFIG)
    assert config.params("cam0").max_age == 20 and config.params("cam0").min_hits == 3
    assert config.params("cam0", "detector-int8").max_age == 40
    assert config.params("cam2", "detector-int8").min_hits == 2
    assert config.tracked("cam0", "detector") and not config.tracked("cam0", "classifier")
    assert not config.tracked("cam1", "detector")
    with pytest.raises(ValueError, match="no camera named 'cam9'"):
        TrackingConfig(cameras=[{"camera": "cam9"}]).check_cameras(["cam0"])
    with pytest.raises(ValueError, match="tracking parameters of models.m and camera 'cam0'.*low_score"):
        TrackingConfig.model_validate({"models": {"m": {"low_score": 0.4}},
                                       "cameras": [{"camera": "cam0", "tracker": {"high_score": 0.3}}]})


def test_the_sink_tracks_per_camera_and_leaves_the_result_on_the_frame() -> None:
    got: list[TrackEvent] = []
    hub = build_tracking(TrackingConfig.model_validate(CONFIG), ["cam0", "cam1", "cam2"], got.extend)
    assert hub is not None and hub.cameras == ["cam0", "cam2"]  # cam1 switched off has no state at all
    detector = runtime("detector")
    frames = []
    for k in range(12):
        f = frame("cam0", k)
        hub.on_result(f, result(240 + 10 * k), detector)
        frames.append(f)
    tracked = tracked_of(frames[-1])
    assert tracked is not None and tracked.detection_ids == [1]
    assert tracked_of(frames[1]).detection_ids == [None]  # min_hits 3 on cam0
    assert [(e.type, e.direction) for e in got] == [(LINE_CROSS, "out")]  # moving right across a line drawn down
    assert hub.counts()["cam0"]["lines"]["door"]["out"] == {"person": 1}

    off = frame("cam1", 0)
    hub.on_result(off, result(100), detector)
    assert tracked_of(off) is None
    assert add_tracking({"kind": "detection"}, off) == {"kind": "detection"}


def test_the_result_message_carries_track_ids_and_the_tracking_object() -> None:
    hub = build_tracking(TrackingConfig(enabled=True), ["cam0"])
    assert hub is not None
    for k in range(3):
        f = frame("cam0", k)
        two = InferenceResult("detection", detections=[Detection((100, 100, 140, 180), 0.9, 0, "person"),
                                                       Detection((300, 100, 340, 180), 0.05, 0, "person")])
        hub.on_result(f, two, runtime("detector"))
    message = add_tracking(two.to_dict(max_items=20), f)
    assert [d.get("track_id") for d in message["detections"]] == [1, None]  # the second scores under low_score
    assert message["tracking"]["track_epoch"] == 1
    assert message["tracking"]["tracks"] == [{"id": 1, "state": "confirmed", "box": [100.0, 100.0, 140.0, 180.0],
                                              "score": 0.9, "age": 3, "hits": 3, "class_id": 0, "label": "person"}]


def test_ids_survive_a_model_swap_and_a_model_without_tracking_pauses_it() -> None:
    hub = build_tracking(TrackingConfig.model_validate(CONFIG), ["cam0"])
    assert hub is not None
    for k in range(5):
        hub.on_result(frame("cam0", k), result(100 + 5 * k), runtime("detector"))
    paused = frame("cam0", 5)
    hub.on_result(paused, result(125), runtime("classifier"))
    assert tracked_of(paused) is None
    swapped = runtime("detector-int8")  # an adaptation switch to another variant
    for k in range(6, 9):
        f = frame("cam0", k)
        hub.on_result(f, result(100 + 5 * k), swapped)
    assert tracked_of(f).detection_ids == [1]
    assert hub.camera("cam0").params.max_age == 40


def test_a_camera_restart_resets_its_ids_and_says_so() -> None:
    got: list[TrackEvent] = []
    hub = build_tracking(TrackingConfig(enabled=True), ["cam0", "cam1"], got.extend)
    assert hub is not None
    for k in range(4):
        for camera in ("cam0", "cam1"):
            hub.on_result(frame(camera, k), result(100), runtime("detector"))
    events = hub.reset("cam0", "camera_restarted")
    assert [(e.type, e.camera, e.epoch, e.ended_tracks) for e in events] == [(TRACKS_RESET, "cam0", 2, 1)]
    assert got == events
    assert hub.reset("cam9", "camera_restarted") == []
    hub.on_result(frame("cam0", 10), result(400), runtime("detector"))
    again, other = frame("cam0", 11), frame("cam1", 11)
    hub.on_result(again, result(400), runtime("detector"))
    hub.on_result(other, result(100), runtime("detector"))
    assert tracked_of(again).epoch == 2 and tracked_of(again).detection_ids == [1]
    assert tracked_of(other).epoch == 1 and tracked_of(other).detection_ids == [1]


def test_the_event_thread_emits_in_order_drops_the_oldest_and_survives_a_failing_emit() -> None:
    emitted: list[tuple[str, dict]] = []
    release = threading.Event()

    def emit(type_: str, **fields: object) -> None:
        release.wait(5)
        if fields.get("track_id") == 3:
            raise RuntimeError("store is gone")
        emitted.append((type_, fields))

    forwarder = EventForwarder(emit, capacity=3)
    events = [TrackEvent(LINE_CROSS, "cam0", 1, track_id=k, name="door", direction="in") for k in range(6)]
    forwarder.offer(events)  # before the thread runs: six into three places
    forwarder.start()
    release.set()
    forwarder.stop(timeout=5)
    assert forwarder.dropped == 3 and forwarder.failed == 1
    assert [fields["track_id"] for _, fields in emitted] == [4, 5]
    assert emitted[0] == (LINE_CROSS, {"camera": "cam0", "track_epoch": 1, "track_id": 4, "line": "door",
                                       "direction": "in"})


def test_tracking_starts_only_when_needed_and_stops_its_thread() -> None:
    emitted: list[tuple[str, dict]] = []
    assert Tracking.start(TrackingConfig(), ["cam0"], lambda t, **f: emitted.append((t, f))) is None
    tracking = Tracking.start(TrackingConfig.model_validate(CONFIG), ["cam0"], lambda t, **f: emitted.append((t, f)))
    assert tracking is not None
    try:
        for k in range(12):
            tracking.on_result(frame("cam0", k), result(240 + 10 * k), runtime("detector"))
        tracking.camera_restarted("cam0")
    finally:
        tracking.stop(timeout=5)
    assert [t for t, _ in emitted] == [LINE_CROSS, TRACKS_RESET]
    assert tracking.summary() == {"cameras": {"cam0": {"track_epoch": 2, "zones": {},
                                                       "lines": {"door": {"in": {}, "out": {"person": 1}}}}},
                                  "events": {"line_cross": 1, "tracks_reset": 1}, "events_dropped": 0,
                                  "events_failed": 0}
