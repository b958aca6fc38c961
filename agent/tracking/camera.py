"""One camera's tracking state: its tracker, zones, lines, id epoch and frame clock.

It belongs to the camera, not to the model that serves it: a hot swap of the detector, or an adaptation switch to
another variant, calls `configure` at most (new parameters, same tracks and ids), while a camera restart calls
`reset`, which ends every track, starts the ids again at 1 in a new epoch and says so (`tracks_reset`). A change of
frame size mid-stream is a camera restart too. `update` and `reset` come from different threads (results thread,
capture or control thread): one lock, never held for long, orders them. `set_shapes` (the `set_zones` command)
replaces the zones and lines live: an unchanged one keeps its visits, a changed or removed one ends them.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from agent.tracking.config import CameraTrackingConfig, TrackerParams
from agent.tracking.errors import TrackingConfigError
from agent.tracking.tracker import CONFIRMED, ByteTracker, Detections, Step, TrackRecord
from agent.tracking.types import (TRACKING_PROBLEM, TRACKS_RESET, ZONE_CHANGED_REASON, ShapeView, TrackedResult,
                                  TrackEvent, TrackView)
from agent.tracking.zones import LineMonitor, Observed, ZoneMonitor
from engines.postprocess.base import Detection

DetectionLike = Detection | Mapping[str, Any]  # a postprocessor's Detection, or its to_dict() form
DROP_FACTOR = 3.0  # a gap this many usual intervals long is a drop, kept out of the interval's average


def _fields(item: DetectionLike) -> tuple[Sequence[float], float, int | None, str | None]:
    if type(item) is dict:  # the common case first (a result's to_dict() form); a subclass takes the long way
        return item["box"], item["score"], item.get("class_id"), item.get("label")
    if isinstance(item, Detection):
        return item.box, item.score, item.class_id, item.label
    return item["box"], item["score"], item.get("class_id"), item.get("label")


def detections_of(items: Sequence[DetectionLike]) -> tuple[Detections, np.ndarray]:
    """Arrays of the usable detections (finite boxes with width and height), and their indices among `items`."""
    if not items:
        return Detections.empty(), np.zeros(0, dtype=np.int64)
    rows = list(map(_fields, items))
    boxes_in, scores_in, ids_in, labels_in = zip(*rows)
    boxes = np.array(boxes_in, dtype=np.float64).reshape(-1, 4)
    scores = np.array(scores_in, dtype=np.float64)
    usable = np.isfinite(boxes).all(axis=1) & np.isfinite(scores) & (boxes[:, 2] > boxes[:, 0]) & \
        (boxes[:, 3] > boxes[:, 1])
    if usable.all():  # the usual case: no row to leave out
        index = np.arange(len(rows))
        class_ids, labels = list(ids_in), list(labels_in)
        boxes_kept, scores_kept = boxes, scores
    else:
        index = np.flatnonzero(usable)
        picked = index.tolist()
        class_ids, labels = [ids_in[i] for i in picked], [labels_in[i] for i in picked]
        boxes_kept, scores_kept = boxes[index], scores[index]
    keys = [label if label is not None else class_id for class_id, label in zip(class_ids, labels)]
    return Detections(boxes_kept, scores_kept, keys, class_ids, labels), index


class CameraTracking:
    """Tracks, zones and lines of one camera; see the module docstring for who calls what."""

    def __init__(self, camera: str, params: TrackerParams, config: CameraTrackingConfig | None = None) -> None:
        self.camera = camera
        self._config = config or CameraTrackingConfig(camera=camera)
        self._lock = threading.Lock()
        self._tracker = ByteTracker(params)
        self.epoch = 1
        self._frame_size: tuple[int, int] | None = None
        self._zones: list[ZoneMonitor] = []
        self._lines: list[LineMonitor] = []
        self._last_ts: float | None = None
        self._interval: float | None = None
        self._frames = 0  # frames since the last reset
        self._signature: tuple = ()  # the last frame's epoch and reported (id, state) pairs: did anything change
        self._shapes: tuple[ShapeView, ...] = ()  # zones and lines with their counts, rebuilt when a count moves
        self.reported = 0  # tracks reported in the last frame

    @property
    def frame_size(self) -> tuple[int, int] | None:
        """(width, height) of the frames tracked, None before the first."""
        return self._frame_size

    @property
    def shapes_config(self) -> CameraTrackingConfig:
        """The zones and lines in force (the config's, or the last `set_shapes`)."""
        return self._config

    def set_shapes(self, config: CameraTrackingConfig) -> list[TrackEvent]:
        """New zones and lines, at once: OutsideFrame (nothing changed) when a pixel shape does not fit the frame
        size seen so far. A shape whose name and definition stay keeps its visits and sides; a changed or removed
        zone ends its visits (zone_leave, reason `zone_changed`); counts stay by name (they are the camera's run)."""
        with self._lock:
            if self._frame_size is not None:
                config.check_frame(self._frame_size)
            self._config = config
            if self._frame_size is None:
                return []  # bound at the first frame
            return self._bind(self._frame_size, self._last_ts or 0.0)

    @property
    def params(self) -> TrackerParams:
        """The parameters in force."""
        return self._tracker.params

    def configure(self, params: TrackerParams) -> None:
        """New parameters (another model took over); tracks and ids stay."""
        with self._lock:
            self._tracker.params = params

    def update(self, detections: Sequence[DetectionLike], frame_ts: float,
               frame_size: tuple[int, int]) -> TrackedResult:
        """Track one frame: `detections` in frame pixels, `frame_ts` in seconds (any monotonic clock), `frame_size`
        (width, height)."""
        with self._lock:
            events: list[TrackEvent] = []
            if self._frame_size is not None and frame_size != self._frame_size:
                events += self._reset("frame_size_changed", frame_ts)
            if frame_size != self._frame_size:
                events += self._bind(frame_size, frame_ts)
            dets, index = detections_of(detections)
            step = self._tracker.step(dets, self._advance(frame_ts))
            events += self._observe(step, frame_ts)
            self._frames += 1
            return self._result(step, dets, frame_ts, events, index, len(detections))

    def reset(self, reason: str, ts: float | None = None) -> list[TrackEvent]:
        """End every track (the camera restarted): zone_leave for visits in progress and one tracks_reset; nothing
        when no frame was tracked since the last reset (a camera's first start)."""
        with self._lock:
            return self._reset(reason, ts)

    def counts(self) -> dict[str, Any]:
        """Counts per zone and line, per class (they outlive resets: they are the camera's, over its run)."""
        with self._lock:
            return {"track_epoch": self.epoch, "zones": {z.config.name: z.counts() for z in self._zones},
                    "lines": {ln.config.name: ln.counts() for ln in self._lines}}

    def _reset(self, reason: str, ts: float | None = None) -> list[TrackEvent]:
        if self._frames == 0 and not self._tracker.tracks:
            return []
        ended = self._tracker.end_all()
        when = ts if ts is not None else (self._last_ts or 0.0)
        events = [zone.end(track_id, when, self.epoch, "reset")
                  for zone in self._zones for track_id in list(zone.inside)]
        for line in self._lines:
            line.sides.clear()
        self.epoch += 1
        self._frames = 0
        self._last_ts = self._interval = None
        self._shapes = self._shape_views()  # nobody inside any more
        confirmed = sum(1 for t in ended if t.track_id is not None)
        return [*events, TrackEvent(TRACKS_RESET, self.camera, self.epoch, reason=reason, ended_tracks=confirmed)]

    def _bind(self, size: tuple[int, int], ts: float) -> list[TrackEvent]:
        """Zones and lines in pixels of this frame size; one that does not fit is off, with a tracking_problem.
        Counts carry over by name; visits and sides only where the shape and the size stay (else they end)."""
        same_size = size == self._frame_size
        self._frame_size = size
        old_zones = {z.config.name: z for z in self._zones}
        old_lines = {ln.config.name: ln for ln in self._lines}
        self._zones, self._lines, events = [], [], []
        for zone_config in self._config.zones:
            try:
                zone = ZoneMonitor(zone_config, zone_config.pixels(zone_config.polygon, size), self.camera)
            except TrackingConfigError as exc:
                events.append(self._problem(exc))
                continue
            old = old_zones.pop(zone_config.name, None)
            if old is not None:  # counts are the camera's run; keep them across a resize or a live change
                zone.entered, zone.left, zone.dwelled = old.entered, old.left, old.dwelled
                if same_size and old.config == zone_config:
                    zone.inside = old.inside
                else:
                    events += self._end_visits(old, ts)
            self._zones.append(zone)
        for old in old_zones.values():  # removed (or now refused): its visits end
            events += self._end_visits(old, ts)
        for line_config in self._config.lines:
            try:
                line = LineMonitor(line_config, line_config.pixels(line_config.points, size), self.camera)
            except TrackingConfigError as exc:
                events.append(self._problem(exc))
                continue
            if line_config.name in old_lines:
                previous = old_lines[line_config.name]
                line.crossed = previous.crossed
                if same_size and previous.config == line_config:
                    line.sides = previous.sides
            self._lines.append(line)
        self._shapes = self._shape_views()
        return events

    def _end_visits(self, zone: ZoneMonitor, ts: float) -> list[TrackEvent]:
        return [zone.end(track_id, ts, self.epoch, ZONE_CHANGED_REASON) for track_id in list(zone.inside)]

    def _shape_views(self) -> tuple[ShapeView, ...]:
        """The zones and lines as the overlay draws them, with their counts now."""
        zones = [ShapeView("zone", z.config.name, tuple(map(tuple, z.polygon.tolist())),
                           f"{len(z.inside)} inside, {sum(z.entered.values())} entered") for z in self._zones]
        lines = [ShapeView("line", ln.config.name, (ln.a, ln.b),
                           f"in {sum(ln.crossed['in'].values())}, out {sum(ln.crossed['out'].values())}")
                 for ln in self._lines]
        return (*zones, *lines)

    def _problem(self, exc: TrackingConfigError) -> TrackEvent:
        return TrackEvent(TRACKING_PROBLEM, self.camera, self.epoch, code=exc.code, message=exc.detail)

    def _advance(self, ts: float) -> float:
        """Frames elapsed since the last update, in the camera's usual interval (1 when it is not known yet)."""
        last, self._last_ts = self._last_ts, ts
        if last is None or not math.isfinite(ts) or ts <= last:
            return 1.0
        gap = ts - last
        if self._interval is None:
            self._interval = gap
        dt = gap / self._interval
        if dt < DROP_FACTOR:
            self._interval = 0.9 * self._interval + 0.1 * gap
        return min(dt, float(self._tracker.params.max_age + 1))

    def _observe(self, step: Step, ts: float) -> list[TrackEvent]:
        events: list[TrackEvent] = []
        for track in step.ended:
            if track.track_id is None:
                continue
            for zone in self._zones:
                if track.track_id in zone.inside:
                    events.append(zone.end(track.track_id, ts, self.epoch, "track_ended"))
            for line in self._lines:
                line.end(track.track_id)
        boxes = step.boxes
        centres = np.empty((len(boxes), 2))
        centres[:, 0] = (boxes[:, 0] + boxes[:, 2]) / 2
        centres[:, 1] = (boxes[:, 1] + boxes[:, 3]) / 2
        for track, centre in zip(step.tracks, centres.tolist()):
            if track.detection >= 0:  # the trail holds where it was seen, from its first box on
                track.add_point((centre[0], centre[1]))
        if not (self._zones or self._lines):
            return events
        rows = [k for k, t in enumerate(step.tracks) if t.state == CONFIRMED and t.detection >= 0]
        tracks = [step.tracks[k] for k in rows]
        seen = Observed([int(t.track_id or 0) for t in tracks], [t.class_id for t in tracks],
                        [t.label for t in tracks], step.boxes[rows])
        for zone in self._zones:
            events += zone.observe(seen, ts, self.epoch)
        for line in self._lines:
            events += line.observe(seen, self.epoch)
        return events

    def _result(self, step: Step, dets: Detections, ts: float, events: list[TrackEvent], index: np.ndarray,
                count: int) -> TrackedResult:
        ids: list[int | None] = [None] * count
        boxes = step.boxes.copy()
        seen = [(row, track.detection) for row, track in enumerate(step.tracks) if track.detection >= 0]
        if seen:
            rows, cols = np.array(seen, dtype=np.int64).T
            boxes[rows] = dets.boxes[cols]  # what the detector saw; the filter's box only coasts
            where = index[cols].tolist()
            for k, row in enumerate(rows.tolist()):
                track_id = step.tracks[row].track_id
                if track_id is not None:
                    ids[where[k]] = track_id
        views = [_view(track, box) for track, box in zip(step.tracks, map(tuple, boxes.tolist()))]
        result = TrackedResult(self.camera, self.epoch, ts, views, events, ids, self._tracker.params.coast_frames,
                               self._frame_size)
        reported = result.reported()
        signature = (self.epoch, sorted((t.track_id or 0, t.state) for t in reported))
        result.changed = bool(events) or signature != self._signature
        self._signature, self.reported = signature, len(reported)
        if events:  # a count moved (or a shape was switched off)
            self._shapes = self._shape_views()
        result.shapes = self._shapes
        return result


def _view(track: TrackRecord, box: tuple[float, float, float, float]) -> TrackView:
    return TrackView.of(track.track_id, track.state, box, track.score, track.class_id, track.label, track.age,
                        track.hits, track.misses, track.trail_view)
