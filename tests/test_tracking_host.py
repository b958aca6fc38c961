"""Tracking in the agent through the hooks the daemon calls (agent.daemon.tracking_host), without the composition root:
off costs nothing, track ids in the MQTT results and `[mqtt] results = "tracks"`, the `set_zones` command through
the real dispatcher and controller (codes, rate limit, persisted in a real SQLite state store and applied again at
the next start, shown in `status`), ids across a model swap and a camera restart, the Prometheus series over real
HTTP, and the overlay's pixels. tests/test_tracking_agent.py runs the same with a whole agent on a real broker."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import numpy as np
import pytest

from agent.config.tree import AgentConfig
from agent.control.commands import CommandDispatcher
from agent.daemon.control import AgentController, ControlParts
from agent.daemon.result_sinks import ResultSinks
from agent.daemon.runner import Agent
from agent.daemon.telemetry_loop import PrometheusExporter
from agent.daemon.tracking_host import IDLE, LIVE_SHAPES_KEY, TrackingHost
from agent.sources.base import Frame
from agent.storage.state import StateStore
from agent.tracking.types import TRACKING_PROBLEM, ZONES_CHANGED
from agent.video.overlay import LINE_COLOR, ZONE_COLOR, color_of, render
from kernel.errors import EdgeError
from engines.postprocess.base import Detection, InferenceResult
from tests.fixtures_mqtt import free_port
from tests.helpers import wait_for

SIZE = (640, 480)
IMAGE = np.zeros((SIZE[1], SIZE[0], 3), np.uint8)
TRACKING = {"enabled": True, "tracker": {"min_hits": 2},
            "cameras": [{"camera": "cam0", "lines": [{"name": "door", "points": [[300, 0], [300, 480]]}],
                         "zones": [{"name": "hall", "polygon": [[320, 100], [620, 100], [620, 460], [320, 460]]}]},
                        {"camera": "side", "tracker": {"enabled": False}}]}
WALK = [float(x) for x in range(210, 390, 10)]  # 10 px a frame: across the line (x=300) and into the zone (320..)
CAMERAS = [{"kind": "synthetic", "name": "cam0", "width": 640, "height": 480},
           {"kind": "synthetic", "name": "side", "width": 640, "height": 480}]


def config(tmp_path: Path, **extra: Any) -> AgentConfig:
    return AgentConfig(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", cameras=CAMERAS,
                       tracking=TRACKING, **extra)


def runtime(name: str) -> SimpleNamespace:
    """The part of a ModelRuntime the tracking sink reads: its manifest's name."""
    return SimpleNamespace(source=SimpleNamespace(manifest=SimpleNamespace(name=name)))


def person(x: float, y: float = 300) -> InferenceResult:
    return InferenceResult("detection", detections=[Detection((x, y - 80, x + 40, y), 0.9, 0, "person")])


class Events:
    """The agent's emit: every event, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def __call__(self, type_: str, **fields: Any) -> None:
        with self.lock:
            self.seen.append((type_, fields))

    def types(self) -> list[str]:
        with self.lock:
            return [t for t, _ in self.seen]


@pytest.fixture
def store(tmp_path: Path):
    (tmp_path / "state").mkdir()
    db = StateStore(tmp_path / "state" / "state.db")
    yield db
    db.close()


def feed(sinks: ResultSinks, camera: str, xs: list[float], model: str = "det", start: int = 0) -> list[Frame]:
    frames = []
    for i, x in enumerate(xs, start):
        frame = Frame(IMAGE, i, i / 10, camera)
        sinks(frame, person(x), runtime(model))
        frames.append(frame)
    return frames


def test_off_by_default_nothing_runs_and_nothing_is_registered(tmp_path: Path) -> None:
    sinks, events = ResultSinks(), Events()
    cfg = AgentConfig(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    assert not cfg.tracking.enabled and cfg.mqtt.results == "frames"
    before = set(threading.enumerate())
    host = IDLE.start(cfg, None, events, sinks)
    assert host is IDLE and not host.active and sinks.names == [] and set(threading.enumerate()) == before
    assert Agent(cfg).tracking is IDLE  # what an agent holds before its start
    assert host.status() is None and host.telemetry() is None and events.seen == []
    host.camera_restarted("cam0")
    host.stop()
    with pytest.raises(EdgeError) as refused:
        host.set_zones("cam0", [], None)
    assert refused.value.code == "TRACKING_OFF"
    sent: list[dict] = []
    sinks.add("mqtt", host.results_sink(lambda head, make: sent.append(make()), lambda f: {"camera": f.source}))
    feed(sinks, "cam0", [100, 100])
    assert [m.get("tracking") for m in sent] == [None, None] and "track_id" not in sent[0]["detections"][0]


def test_results_carry_track_ids_and_with_results_tracks_only_changes_go_out(tmp_path: Path, store) -> None:
    for mode, expected in (("frames", 24), ("tracks", None)):
        sinks, events = ResultSinks(), Events()
        host = IDLE.start(config(tmp_path, mqtt={"results": mode}), store, events, sinks)
        sent: list[dict] = []
        sinks.add("mqtt", host.results_sink(lambda head, make: sent.append(make()), lambda f: {"camera": f.source}))
        try:
            assert sinks.names == ["tracking", "mqtt"]
            # standing still (confirmed at the second frame), then across the line at x=300 and into the zone
            feed(sinks, "cam0", [200.0] * 6 + WALK)
            assert wait_for(lambda: "line_cross" in events.types(), 5)
        finally:
            host.stop()
        if expected is not None:
            assert len(sent) == expected == 6 + len(WALK)
        else:  # first seen (tentative: no track yet), confirmed, then the crossing frames with events
            assert 2 <= len(sent) <= 6
            assert [m["tracking"]["tracks"] for m in sent[:2]] == [[], [sent[1]["tracking"]["tracks"][0]]]
            assert any(m["tracking"]["events"] for m in sent)
        assert sent[-1]["detections"][0]["track_id"] == 1
        assert sent[-1]["tracking"]["track_epoch"] == 1 and sent[-1]["tracking"]["tracks"][0]["id"] == 1
        assert [t for t in events.types() if t != "dwell"] == ["line_cross", "zone_enter"]


def test_ids_survive_a_model_swap_and_restart_when_the_camera_does(tmp_path: Path, store) -> None:
    sinks, events = ResultSinks(), Events()
    host = IDLE.start(config(tmp_path), store, events, sinks)
    try:
        before = feed(sinks, "cam0", [100, 104, 108], model="det-fp16")
        after = feed(sinks, "cam0", [112, 116], model="det-int8", start=3)  # a hot swap: another runtime, same ids
        assert [host.of(f).detection_ids for f in (*before[1:], *after)] == [[1]] * 4
        assert host.of(after[-1]).epoch == 1
        host.camera_restarted("cam0")
        again = feed(sinks, "cam0", [300, 304], start=5)
        assert host.of(again[-1]).epoch == 2 and host.of(again[-1]).detection_ids == [1]
        assert wait_for(lambda: "tracks_reset" in events.types(), 5)
        reset = dict(events.seen)["tracks_reset"]
        assert reset == {"camera": "cam0", "track_epoch": 2, "reason": "camera_restarted", "ended_tracks": 1}
        feed(sinks, "side", [100, 104])  # not tracked: nothing left on its frames
        assert host.status()["cameras"].keys() == {"cam0"}
    finally:
        host.stop()


def dispatcher_for(host: TrackingHost, store: StateStore, events: Events, path: Path) -> CommandDispatcher:
    """The real command table and controller over the parts set_zones and its persistence read (tracking, store,
    emit, stop_event); any other part it reached would fail the test."""
    parts = ControlParts(config=AgentConfig(), stop_event=threading.Event(), emit=events, live_snapshot=unreached,
                         restart_capture=unreached, store=lambda: store, deployments=unreached, manager=unreached,
                         previous=unreached, adapt=unreached, video=unreached, dispatcher=unreached,
                         tracking=lambda: host)
    return CommandDispatcher(AgentController(parts), path)


def unreached(*args: object, **kwargs: object) -> NoReturn:
    raise AssertionError("set_zones reads only the tracking host, the state store, emit and stop_event")


def command(dispatcher: CommandDispatcher, args: dict, id_: str) -> dict:
    return dispatcher.dispatch(json.dumps({"id": id_, "command": "set_zones", "args": args}).encode(), "local")


def test_set_zones_is_checked_rate_limited_persisted_and_applied_at_the_next_start(tmp_path: Path, store) -> None:
    sinks, events = ResultSinks(), Events()
    host = IDLE.start(config(tmp_path), store, events, sinks)
    dispatcher = dispatcher_for(host, store, events, tmp_path / "replies.db")
    try:
        bow_tie = [[0, 0], [100, 100], [100, 0], [0, 100]]
        refusals = {
            "TRACKING_ZONE_SELF_INTERSECTING": {"camera": "cam0", "zones": [{"name": "z", "polygon": bow_tie}]},
            "TRACKING_LINE_ZERO_LENGTH": {"camera": "cam0", "lines": [{"name": "l", "points": [[5, 5], [5, 5]]}]},
            "TRACKING_OUTSIDE_FRAME": {"camera": "cam0", "lines": [{"name": "l", "points": [[5, 5], [700, 5]]}]},
            "TRACKING_ZONE_DEGENERATE": {"camera": "cam0", "zones": [{"name": "z", "polygon": [[0, 0], [9, 9],
                                                                                             [20, 20]]}]},
            "TRACKING_OFF": {"camera": "side", "zones": []},
            "INVALID_COMMAND": {"camera": "door", "zones": []},
        }
        for code, args in refusals.items():
            reply = command(dispatcher, args, f"bad-{code}")
            assert not reply["ok"] and reply["error"]["code"] == code, reply
        assert command(dispatcher, {"camera": "cam0", "zones": [], "lines": [{"name": "x", "points": [[0, 0], [1, 1]]},
                                                                           {"name": "x", "points": [[0, 0], [2, 2]]}]},
                       "twice")["error"]["code"] == "INVALID_COMMAND"
        assert host.status()["cameras"]["cam0"]["shapes"]["source"] == "config"  # nothing changed
        zone = {"name": "desk", "coords": "normalized", "polygon": [[0.1, 0.1], [0.4, 0.1], [0.4, 0.5]], "dwell_s": 5}
        reply = command(dispatcher, {"camera": "cam0", "zones": [zone]}, "good-0")
        assert reply["ok"] and reply["result"] == {"camera": "cam0", "zones": ["desk"], "lines": ["door"],
                                                   "source": "live", "ended_visits": 0, "persisted": True}, reply
        status = host.status()["cameras"]["cam0"]["shapes"]
        assert status["source"] == "live" and [z["name"] for z in status["zones"]] == ["desk"]
        assert status["zones"][0]["polygon"] == [[0.1, 0.1], [0.4, 0.1], [0.4, 0.5]]
        assert store.get_kv(LIVE_SHAPES_KEY)["cam0"]["zones"][0]["name"] == "desk"
        assert wait_for(lambda: ZONES_CHANGED in events.types(), 5)
        for i in range(1, 30):  # 30 a minute per channel; the refusals above cost nothing
            assert command(dispatcher, {"camera": "cam0", "zones": [zone]}, f"good-{i}")["ok"]
        limited = command(dispatcher, {"camera": "cam0", "zones": [zone]}, "one-too-many")
        assert limited["error"]["code"] == "RATE_LIMITED"
    finally:
        dispatcher.close()
        host.stop()

    # the next start: the zones set live, not the file's; one stored for a camera no longer tracked is said
    store.set_kv(LIVE_SHAPES_KEY, {**store.get_kv(LIVE_SHAPES_KEY), "side": {"zones": [], "lines": []}})
    events = Events()
    again = IDLE.start(config(tmp_path), store, events, ResultSinks())
    try:
        shapes = again.status()["cameras"]["cam0"]["shapes"]
        assert shapes["source"] == "live" and [z["name"] for z in shapes["zones"]] == ["desk"]
        assert events.seen == [(TRACKING_PROBLEM, {"camera": "side", "code": "TRACKING_OFF", "message": "zones set "
                                "live for camera 'side' are not applied: it is not tracked on this agent"})]
        reply, entry = again.set_zones("cam0", None, None, revert=True)
        assert entry is None and reply["source"] == "config" and reply["zones"] == ["hall"]
        assert again.status()["cameras"]["cam0"]["shapes"]["source"] == "config"
    finally:
        again.stop()


def test_a_stored_zone_the_rules_now_refuse_is_reported_and_the_files_zones_run(tmp_path: Path, store) -> None:
    store.set_kv(LIVE_SHAPES_KEY, {"cam0": {"zones": [{"name": "z", "polygon": [[0, 0], [9, 9], [9, 0], [0, 9]]}]}})
    events = Events()
    host = IDLE.start(config(tmp_path), store, events, ResultSinks())
    try:
        assert [(t, f["code"]) for t, f in events.seen] == [(TRACKING_PROBLEM, "TRACKING_ZONE_SELF_INTERSECTING")]
        assert host.status()["cameras"]["cam0"]["shapes"]["source"] == "config"
    finally:
        host.stop()


def test_prometheus_exposes_the_counts_per_zone_line_and_class(tmp_path: Path, store) -> None:
    sinks, events = ResultSinks(), Events()
    host = IDLE.start(config(tmp_path), store, events, sinks)
    try:
        feed(sinks, "cam0", WALK)
        assert wait_for(lambda: "zone_enter" in events.types(), 5)
        sample = {"fps": 10.0, "frames": 7, "dropped_frames": 0, "tracking": host.telemetry()}
    finally:
        host.stop()
    port = free_port()
    exporter = PrometheusExporter(port, "127.0.0.1")
    try:
        exporter(sample)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        exporter({"fps": 1.0, "frames": 8, "dropped_frames": 0})  # tracking gone from the sample: no series left
        after = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        exporter.stop()
    # walking down the picture, its left-hand side is the picture's right: a move to the right is "out"
    assert 'edge_agent_tracking_line_crossings{camera="cam0",class="person",direction="out",line="door"} 1.0' in text
    assert 'edge_agent_tracking_zone_objects{camera="cam0",class="person",count="entered",zone="hall"} 1.0' in text
    assert 'edge_agent_tracking_zone_objects{camera="cam0",class="person",count="inside",zone="hall"} 1.0' in text
    assert 'edge_agent_tracking_events{type="line_cross"} 1.0' in text
    assert (
        'edge_agent_tracking_tracks{camera="cam0"} 1.0' in text
        and 'edge_agent_tracking_epoch{camera="cam0"} 1.0' in text
    )
    assert 'edge_agent_tracking_events_lost{why="dropped"} 0.0' in text
    assert "edge_agent_tracking_line_crossings{" not in after and "edge_agent_tracking_events_lost{" not in after


def test_the_overlay_draws_zones_lines_ids_trails_and_counts(tmp_path: Path, store) -> None:
    sinks, events = ResultSinks(), Events()
    host = IDLE.start(config(tmp_path), store, events, sinks)
    try:
        frames = feed(sinks, "cam0", WALK)
    finally:
        host.stop()
    tracked = host.of(frames[-1])
    assert tracked is not None
    gray = np.full((SIZE[1], SIZE[0], 3), 128, np.uint8)
    plain = render(gray, person(380))
    picture = render(gray, person(380), tracking=tracked)
    near = lambda pixel, color: int(np.abs(pixel.astype(int) - np.array(color)).max()) <= 60  # noqa: E731 - a one-line colour test for the asserts below
    assert near(picture[250, 620], ZONE_COLOR) and near(picture[460, 470], ZONE_COLOR)  # the zone's right, bottom edges
    assert near(picture[150, 300], LINE_COLOR) and near(picture[470, 300], LINE_COLOR)  # the line x=300
    assert not near(plain[250, 620], ZONE_COLOR) and not near(plain[150, 300], LINE_COLOR)
    trail = [(int(round(x)), int(round(y))) for x, y in tracked.tracks[0].trail]
    assert len(trail) >= 6 and trail[0][0] < 300 < trail[-1][0]
    between = ((trail[1][0] + trail[2][0]) // 2, trail[1][1])  # on the trail, between two observed centres
    assert near(picture[between[1], between[0]], color_of(1)) and not near(plain[between[1], between[0]], color_of(1))
    label = picture[300:300 + 24, 380:380 + 40]  # "#1" under the box (380..420, 220..300)
    assert (np.abs(label.astype(int) - np.array(color_of(1))).max(axis=2) <= 10).sum() > 50
    counts_label = picture[60:100, 320:520]  # "hall: 1 inside, 1 entered" above the zone's top edge (y=100)
    assert (np.abs(counts_label.astype(int) - np.array(ZONE_COLOR)).max(axis=2) <= 10).sum() > 200
