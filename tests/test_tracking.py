"""The tracker of issue #43 (agent.tracking): ids through misses and crossings, ByteTrack's low-score stage,
class-aware matching, the camera-owned state (model swaps keep ids, camera restarts reset them and say so), and
the assignment solver against brute force. Scenes are scripted frame by frame; no clock is read."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from agent.tracking import CameraTracking, TrackerParams, TrackingConfig, build_tracking, detections_of
from agent.tracking.assignment import assign, hungarian
from agent.tracking.types import TRACKS_RESET
from engines.postprocess.base import Detection

SIZE = (640, 480)


def person(x: float, y: float, score: float = 0.9, label: str | None = "person", class_id: int | None = 0,
           w: float = 40, h: float = 80) -> Detection:
    """A box whose top-left corner is (x, y)."""
    return Detection((x, y, x + w, y + h), score, class_id, label)


def run(camera: CameraTracking, frames: list[list[Detection]], start: int = 0) -> list:
    """Feed frames at 30 fps; the TrackedResults."""
    return [camera.update(dets, (start + k) / 30, SIZE) for k, dets in enumerate(frames)]


def ids_of(result) -> list[int | None]:
    return result.detection_ids


def test_ids_are_stable_and_survive_a_short_miss() -> None:
    camera = CameraTracking("cam0", TrackerParams())
    frames = [[person(10 + 6 * f, 100), person(400, 50 + 4 * f)] for f in range(20)]
    for f in (8, 9, 10):  # the first object is not detected for three frames
        frames[f] = frames[f][1:]
    results = run(camera, frames)
    assert ids_of(results[0]) == [None, None]  # tentative: an id only once confirmed (min_hits 2)
    assert ids_of(results[1]) == [1, 2]
    assert [r.tracks[0].state for r in results[8:11]] == ["lost"] * 3
    assert results[9].tracks[0].misses == 2
    assert all(ids_of(r) == [1, 2] for r in results[11:])
    first = next(t for t in results[-1].tracks if t.track_id == 1)
    assert first.hits == 17 and first.age == 20 and first.state == "confirmed"
    assert len(first.trail) == 17 and first.trail[-1][0] > first.trail[0][0]  # observed centres, oldest first


def test_a_lost_track_is_reported_while_it_coasts_then_only_kept() -> None:
    camera = CameraTracking("cam0", TrackerParams(coast_frames=2, max_age=5))
    results = run(camera, [[person(100 + 5 * f, 100)] for f in range(5)] + [[] for _ in range(7)])
    reported = [[t.track_id for t in r.reported()] for r in results]
    assert reported[5:7] == [[1], [1]]  # predicted boxes for two missed frames
    assert reported[7:10] == [[], [], []]  # lost but kept for max_age, not reported
    assert [len(r.tracks) for r in results[5:]] == [1] * 5 + [0, 0]  # survives max_age (5) misses, not a 6th
    coasting = results[5].reported()[0]
    assert coasting.box[0] > results[4].tracks[0].box[0]  # the prediction moved on with the velocity


def test_a_track_lost_at_the_frame_edge_is_not_reported() -> None:
    """An object leaving the picture: its clipped boxes stop at the edge, so a prediction there would be a false box."""
    camera = CameraTracking("cam0", TrackerParams())
    leaving = [[person(560 + 10 * f, 100, w=min(40, 80 - 10 * f))] for f in range(8)]  # clipped at x = 640
    results = run(camera, leaving + [[], []])
    assert results[7].reported()[0].box[2] == 640
    assert [r.reported() for r in results[8:]] == [[], []] and results[8].tracks[0].state == "lost"


def test_ids_hold_when_two_objects_cross() -> None:
    """Two people walk through each other; the filter's velocity carries each id across the overlap."""
    camera = CameraTracking("cam0", TrackerParams())
    frames = [[person(50 + 10 * f, 200), person(450 - 10 * f, 205)] for f in range(41)]
    results = run(camera, frames)
    assert ids_of(results[1]) == [1, 2]
    assert ids_of(results[-1]) == [1, 2]  # the one that started left is still 1, now on the right
    boxes = {t.track_id: t.box for t in results[-1].tracks}
    assert boxes[1][0] > boxes[2][0]


def test_the_low_score_stage_recovers_an_occluded_track() -> None:
    """ByteTrack's second stage: a box scoring under high_score keeps its track; without it (low_score = high_score)
    the same frames end the track and start a new id."""
    def frames() -> list[list[Detection]]:
        out = [[person(100 + 5 * f, 100, score=0.9)] for f in range(5)]
        out += [[person(125 + 5 * f, 100, score=0.3)] for f in range(6)]  # half hidden: low scores
        return out + [[person(155 + 5 * f, 100, score=0.9)] for f in range(3)]

    byte = run(CameraTracking("cam0", TrackerParams(max_age=2)), frames())
    assert all(ids_of(r) == [1] for r in byte[1:])
    assert all(r.tracks[0].state == "confirmed" for r in byte[5:11])

    one_stage = run(CameraTracking("cam0", TrackerParams(max_age=2, low_score=0.5)), frames())
    assert ids_of(one_stage[5]) == [None]  # the low box is ignored
    assert ids_of(one_stage[-1]) == [2]  # a new track once it scores high again


def test_matching_is_class_aware() -> None:
    """A car appearing where a person was lost never takes the person's id (unless class_aware is off)."""
    frames = [[person(100, 100)] for _ in range(4)] + [[person(100, 100, label="car", class_id=2)] for _ in range(3)]
    aware = run(CameraTracking("cam0", TrackerParams()), frames)
    assert ids_of(aware[3]) == [1] and ids_of(aware[5]) == [2]
    assert {t.label for t in aware[-1].tracks} == {"person", "car"}
    blind = run(CameraTracking("cam0", TrackerParams(class_aware=False)), frames)
    assert ids_of(blind[5]) == [1] and blind[-1].tracks[0].label == "car"


def test_classes_match_by_label_so_a_model_with_another_class_order_keeps_ids() -> None:
    camera = CameraTracking("cam0", TrackerParams())
    run(camera, [[person(100 + 4 * f, 100, class_id=0)] for f in range(4)])
    after_swap = run(camera, [[person(116 + 4 * f, 100, class_id=7)] for f in range(3)], start=4)
    assert [ids_of(r) for r in after_swap] == [[1]] * 3


def test_without_labels_the_class_id_is_the_class() -> None:
    camera = CameraTracking("cam0", TrackerParams())
    frames = [[person(100, 100, label=None, class_id=1)]] * 3 + [[person(100, 100, label=None, class_id=3)]] * 2
    results = run(camera, frames)
    assert ids_of(results[2]) == [1] and ids_of(results[4]) == [2]


def test_the_state_is_the_cameras_a_model_swap_keeps_ids_a_restart_resets_them() -> None:
    camera = CameraTracking("cam0", TrackerParams())
    run(camera, [[person(100 + 4 * f, 100), person(300, 100 + 3 * f)] for f in range(5)])
    camera.configure(TrackerParams(high_score=0.4, max_age=10))  # the new model's parameters
    kept = run(camera, [[person(120 + 4 * f, 100), person(300, 115 + 3 * f)] for f in range(3)], start=5)
    assert ids_of(kept[-1]) == [1, 2] and camera.params.max_age == 10

    events = camera.reset("camera_restarted")
    assert [e.type for e in events] == [TRACKS_RESET]
    assert events[0].fields() == {"camera": "cam0", "track_epoch": 2, "reason": "camera_restarted", "ended_tracks": 2}
    assert camera.reset("camera_restarted") == []  # nothing tracked since: nothing to say
    again = run(camera, [[person(400, 300)] for _ in range(3)], start=100)
    assert ids_of(again[-1]) == [1] and again[-1].epoch == 2  # ids start again, in a new epoch


def test_a_new_frame_size_is_a_camera_restart() -> None:
    camera = CameraTracking("cam0", TrackerParams())
    run(camera, [[person(100, 100)] for _ in range(3)])
    resized = camera.update([person(100, 100)], 1.0, (1280, 720))
    assert [e.type for e in resized.events] == [TRACKS_RESET]
    assert resized.events[0].reason == "frame_size_changed" and resized.epoch == 2


def test_a_dropped_frame_moves_the_prediction_by_the_time_that_passed() -> None:
    """Frames at 30 fps, then a gap of three intervals: the predicted box is where the object really is, so a fast
    object keeps its id (a filter that counts calls would predict one step and lose it)."""
    camera = CameraTracking("cam0", TrackerParams())
    for f in range(6):
        camera.update([person(20 * f, 100)], f / 30, SIZE)
    after_gap = camera.update([person(20 * 8, 100)], 8 / 30, SIZE)
    assert ids_of(after_gap) == [1]


def test_detections_arrive_as_records_or_as_their_json_form() -> None:
    records = [person(10, 10, score=0.8), person(100, 100, score=0.7, label=None, class_id=3)]
    as_json = [d.to_dict() for d in records] + [{"box": [5, 5, 5, 9], "score": 0.9}]  # no width: unusable
    dets, index = detections_of(as_json)
    assert index.tolist() == [0, 1]
    assert dets.class_keys == ["person", 3] and dets.scores.tolist() == [0.8, 0.7]
    camera = CameraTracking("cam0", TrackerParams())
    results = run(camera, [as_json, as_json])
    assert ids_of(results[1]) == [1, 2, None]


def test_off_by_default_builds_nothing() -> None:
    assert build_tracking(TrackingConfig(), ["cam0", "cam1"]) is None
    config = TrackingConfig.model_validate({"cameras": [{"camera": "cam1", "tracker": {"enabled": True}}]})
    hub = build_tracking(config, ["cam0", "cam1"])
    assert hub is not None and hub.cameras == ["cam1"]


@pytest.mark.parametrize("seed", range(40))
def test_the_assignment_is_optimal(seed: int) -> None:
    """Maximum-weight matching over the positive pairs, checked against every possible matching."""
    rng = np.random.default_rng(seed)
    weights = np.where(rng.random((rng.integers(1, 6), rng.integers(1, 6))) < 0.6, rng.random((1, 1)), 0.0)
    weights = np.where(weights > 0, rng.random(weights.shape), 0.0)
    matches, free_rows, free_cols = assign(weights)
    n, m = weights.shape
    best = 0.0
    for k in range(min(n, m) + 1):
        for rows in itertools.combinations(range(n), k):
            for cols in itertools.permutations(range(m), k):
                if all(weights[r, c] > 0 for r, c in zip(rows, cols)):
                    best = max(best, sum(weights[r, c] for r, c in zip(rows, cols)))
    assert sum(weights[r, c] for r, c in matches) == pytest.approx(best)
    assert sorted(free_rows + [r for r, _ in matches]) == list(range(n))
    assert sorted(free_cols + [c for _, c in matches]) == list(range(m))


def test_hungarian_minimises_cost() -> None:
    cost = np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
    assert hungarian(cost).tolist() == [1, 0, 2]
