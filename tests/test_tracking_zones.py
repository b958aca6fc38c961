"""Zones and lines of issue #43: refusals with codes, enter / leave / dwell and line crossings with direction on
scripted scenes with exact counts, class filters, pixel and normalized coordinates, resets."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agent.tracking import (CameraTracking, CameraTrackingConfig, LineConfig, OutsideFrame, TrackerParams,
                            TrackingConfig, ZoneConfig, codes_of)
from agent.tracking.types import DWELL, LINE_CROSS, TRACKING_PROBLEM, TRACKS_RESET, ZONE_ENTER, ZONE_LEAVE
from engines.postprocess.base import Detection

SIZE = (640, 480)
FPS = 10.0


def at(x: float, y: float, label: str = "person", w: float = 40, h: float = 80) -> Detection:
    """A box standing on (x, y): its bottom centre."""
    return Detection((x - w / 2, y - h, x + w / 2, y), 0.9, 0 if label == "person" else 2, label)


def walk(start: tuple[float, float], end: tuple[float, float], frames: int, label: str = "person") -> list[Detection]:
    """One box a frame, in a straight line from start to end (both included)."""
    return [at(start[0] + (end[0] - start[0]) * k / (frames - 1), start[1] + (end[1] - start[1]) * k / (frames - 1),
               label) for k in range(frames)]


def camera_with(zones=(), lines=(), **params) -> CameraTracking:
    config = CameraTrackingConfig(camera="cam0", zones=list(zones), lines=list(lines))
    return CameraTracking("cam0", TrackerParams(**params), config)


def play(camera: CameraTracking, *tracks: list[Detection], size: tuple[int, int] = SIZE, skip=()) -> list:
    """Every walker's box each frame (a walker that ended adds nothing); frames in `skip` see no detection at all.
    Returns every event, in order."""
    events = []
    for k in range(max(len(t) for t in tracks)):
        dets = [] if k in skip else [t[k] for t in tracks if k < len(t)]
        events += camera.update(dets, k / FPS, size).events
    return events


def kinds(events) -> list[tuple]:
    return [(e.type, e.track_id, e.name, e.class_name, e.direction) for e in events]


# --- refusals with codes ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("shape", "code"), [
    ({"name": "bowtie", "polygon": [[0, 0], [100, 100], [100, 0], [0, 100]]}, "TRACKING_ZONE_SELF_INTERSECTING"),
    ({"name": "touching", "polygon": [[0, 0], [50, 50], [100, 0], [100, 100], [50, 50], [0, 100]]},
     "TRACKING_ZONE_SELF_INTERSECTING"),
    ({"name": "spike", "polygon": [[0, 0], [100, 0], [100, 100], [100, 50]]}, "TRACKING_ZONE_SELF_INTERSECTING"),
    ({"name": "flat", "polygon": [[0, 0], [50, 0], [100, 0]]}, "TRACKING_ZONE_DEGENERATE"),
    ({"name": "two", "polygon": [[0, 0], [50, 0], [0, 0]]}, "TRACKING_ZONE_DEGENERATE"),
    ({"name": "repeat", "polygon": [[0, 0], [50, 0], [50, 0], [50, 50]]}, "TRACKING_ZONE_DEGENERATE"),
    ({"name": "norm", "coords": "normalized", "polygon": [[0, 0], [1.2, 0], [1, 1]]}, "TRACKING_OUTSIDE_FRAME"),
    ({"name": "negative", "polygon": [[-5, 0], [50, 0], [50, 50]]}, "TRACKING_OUTSIDE_FRAME"),
])
def test_a_bad_zone_is_refused_with_its_code(shape: dict, code: str) -> None:
    with pytest.raises(ValidationError) as caught:
        TrackingConfig.model_validate({"cameras": [{"camera": "cam0", "zones": [shape]}]})
    assert codes_of(caught.value) == [code]
    item = caught.value.errors()[0]
    assert item["loc"][:4] == ("cameras", 0, "zones", 0)
    assert code in item["msg"] and repr(shape["name"]) in item["msg"]


@pytest.mark.parametrize(("line", "code"), [
    ({"name": "dot", "points": [[10, 10], [10, 10]]}, "TRACKING_LINE_ZERO_LENGTH"),
    ({"name": "out", "coords": "normalized", "points": [[0, 0.5], [1.01, 0.5]]}, "TRACKING_OUTSIDE_FRAME"),
])
def test_a_bad_line_is_refused_with_its_code(line: dict, code: str) -> None:
    with pytest.raises(ValidationError) as caught:
        TrackingConfig.model_validate({"cameras": [{"camera": "cam0", "lines": [line]}]})
    assert codes_of(caught.value) == [code]


def test_good_shapes_pass() -> None:
    concave = ZoneConfig(name="L", polygon=[(0, 0), (100, 0), (100, 40), (40, 40), (40, 100), (0, 100)])
    assert concave.pixels(concave.polygon, SIZE) == concave.polygon
    LineConfig(name="edge", coords="normalized", points=((0, 0), (1, 1)))


def test_pixel_shapes_beyond_the_frame_are_refused_when_the_frame_is_known() -> None:
    config = CameraTrackingConfig(camera="cam0", zones=[ZoneConfig(name="far", polygon=[(0, 0), (700, 0), (0, 100)])],
                                  lines=[LineConfig(name="ok", points=((0, 100), (640, 100)))])
    config.check_frame((1280, 720))
    with pytest.raises(OutsideFrame) as caught:
        config.check_frame(SIZE)
    assert caught.value.code == "TRACKING_OUTSIDE_FRAME" and "640x480" in str(caught.value)

    camera = CameraTracking("cam0", TrackerParams(), config)  # at run time: that zone is off, with an event
    first = camera.update([], 0.0, SIZE)
    assert [(e.type, e.code) for e in first.events] == [(TRACKING_PROBLEM, "TRACKING_OUTSIDE_FRAME")]
    assert list(camera.counts()["zones"]) == [] and list(camera.counts()["lines"]) == ["ok"]


def test_names_are_unique_per_camera() -> None:
    with pytest.raises(ValidationError, match="used twice"):
        CameraTrackingConfig(camera="cam0", zones=[ZoneConfig(name="a", polygon=[(0, 0), (9, 0), (0, 9)])],
                             lines=[LineConfig(name="a", points=((0, 0), (9, 9)))])


# --- zones -----------------------------------------------------------------------------------------------------------

YARD = ZoneConfig(name="yard", polygon=[(200, 200), (440, 200), (440, 400), (200, 400)], dwell_s=2.0)


def test_zone_enter_leave_and_dwell_with_exact_counts() -> None:
    camera = camera_with([YARD])
    passer = walk((100, 300), (600, 300), 26)  # through the yard in ~1.2 s: no dwell
    loiterer = walk((320, 100), (320, 300), 11) + [at(320, 300)] * 30 + walk((320, 300), (320, 470), 10)
    outsider = walk((50, 450), (600, 450), 30)  # never inside
    events = play(camera, passer, loiterer, outsider)
    assert kinds(events) == [
        (ZONE_ENTER, 1, "yard", "person", None),  # the passer, at x = 200
        (ZONE_ENTER, 2, "yard", "person", None),  # the loiterer, at y = 200
        (ZONE_LEAVE, 1, "yard", "person", None),
        (DWELL, 2, "yard", "person", None),
        (ZONE_LEAVE, 2, "yard", "person", None),
    ]
    dwell = next(e for e in events if e.type == DWELL)
    assert 2.0 <= dwell.dwell_s < 2.2
    leaves = [e for e in events if e.type == ZONE_LEAVE]
    assert [e.reason for e in leaves] == ["left", "left"] and leaves[0].dwell_s < 2.0 < leaves[1].dwell_s
    assert camera.counts()["zones"]["yard"] == {"entered": {"person": 2}, "left": {"person": 2}, "inside": {},
                                                "dwelled": {"person": 1}}


def test_a_box_jittering_on_the_edge_enters_once() -> None:
    camera = camera_with([YARD])
    on_edge = [at(320, 200 + (5 if k % 2 else -5)) for k in range(20)]  # the yard's top edge, +-5 px
    events = play(camera, walk((320, 120), (320, 195), 8) + on_edge + walk((320, 205), (320, 300), 8))
    assert kinds(events) == [(ZONE_ENTER, 1, "yard", "person", None)]


def test_a_zone_counts_only_its_classes() -> None:
    cars_only = ZoneConfig(name="yard", polygon=YARD.polygon, classes=["car"])
    camera = camera_with([cars_only])
    events = play(camera, walk((100, 300), (600, 300), 20), walk((320, 50), (320, 470), 20, label="car"))
    assert [(e.type, e.class_name) for e in events] == [(ZONE_ENTER, "car"), (ZONE_LEAVE, "car")]


def test_a_visit_ends_when_the_track_ends_or_the_camera_resets() -> None:
    camera = camera_with([YARD], max_age=3)
    events = play(camera, walk((100, 300), (300, 300), 20))  # stops inside, then is never seen again
    events += [e for k in range(20, 25) for e in camera.update([], k / FPS, SIZE).events]
    assert kinds(events)[-1] == (ZONE_LEAVE, 1, "yard", "person", None) and events[-1].reason == "track_ended"

    play(camera, walk((100, 300), (300, 300), 20))
    assert camera.counts()["zones"]["yard"]["inside"] == {"person": 1}
    reset = camera.reset("camera_restarted", ts=5.0)
    assert [(e.type, e.reason) for e in reset] == [(ZONE_LEAVE, "reset"), (TRACKS_RESET, "camera_restarted")]
    counts = camera.counts()
    assert counts["zones"]["yard"]["inside"] == {} and counts["zones"]["yard"]["entered"] == {"person": 2}
    assert counts["track_epoch"] == 2


def test_normalized_and_pixel_zones_see_the_same_events() -> None:
    normalized = ZoneConfig(name="yard", coords="normalized", polygon=[(x / 640, y / 480) for x, y in YARD.polygon],
                            dwell_s=2.0)
    scene = [walk((100, 300), (600, 300), 26), walk((320, 100), (320, 300), 11) + [at(320, 300)] * 25]
    pixel_events = play(camera_with([YARD]), *scene)
    normalized_events = play(camera_with([normalized]), *scene)
    assert kinds(normalized_events) == kinds(pixel_events) and len(pixel_events) == 4
    # the same normalized zone on a camera at twice the resolution: the same place in the picture
    doubled = [[at(d.box[0] * 2 + 40, d.box[3] * 2, w=80, h=160) for d in walker] for walker in scene]
    assert kinds(play(camera_with([normalized]), *doubled, size=(1280, 960))) == kinds(pixel_events)


# --- lines -----------------------------------------------------------------------------------------------------------

DOOR = LineConfig(name="door", points=((100, 240), (540, 240)))  # drawn left to right: moving down is "in"


def test_line_crossings_have_a_direction_and_exact_counts() -> None:
    camera = camera_with(lines=[DOOR])
    down = walk((200, 100), (200, 400), 20)
    up = walk((400, 400), (400, 100), 20)
    car_down = walk((300, 60), (300, 460), 20, label="car")
    events = play(camera, down, up, car_down)
    assert sorted((e.track_id, e.direction, e.class_name) for e in events) == \
        [(1, "in", "person"), (2, "out", "person"), (3, "in", "car")]
    assert all(e.type == LINE_CROSS and e.name == "door" for e in events)
    assert camera.counts()["lines"]["door"] == {"in": {"person": 1, "car": 1}, "out": {"person": 1}}
    assert events[0].fields() == {"camera": "cam0", "track_epoch": 1, "track_id": events[0].track_id, "line": "door",
                                  "class": events[0].class_name, "direction": events[0].direction}


def test_no_crossing_past_the_end_along_the_line_or_from_jitter() -> None:
    camera = camera_with(lines=[DOOR])
    past_the_end = walk((600, 100), (600, 400), 20)
    along = walk((50, 230), (600, 230), 20)
    jitter = [at(320, 240 + (5 if k % 2 else -5)) for k in range(20)]  # within the dead band: 0.1 x 80 px
    assert play(camera, past_the_end, along, jitter) == []
    assert camera.counts()["lines"]["door"] == {"in": {}, "out": {}}


def test_a_crossing_during_missed_frames_counts_once_and_back_counts_out() -> None:
    camera = camera_with(lines=[DOOR])
    there_and_back = walk((320, 150), (320, 330), 10) + walk((320, 330), (320, 150), 10)
    events = play(camera, there_and_back, skip={4, 5, 6})  # not seen while it crosses
    assert [e.direction for e in events] == ["in", "out"]


def test_a_line_counts_only_its_directions_and_classes() -> None:
    camera = camera_with(lines=[LineConfig(name="door", points=DOOR.points, directions="out", classes=[2])])
    events = play(camera, walk((200, 100), (200, 400), 20, label="car"), walk((400, 400), (400, 100), 20, label="car"),
                  walk((300, 400), (300, 100), 20))
    assert [(e.direction, e.class_name) for e in events] == [("out", "car")]  # class id 2 = the car
