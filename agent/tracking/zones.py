"""Zones and lines of one camera, bound to its frame size in pixels: events and counts from observed tracks.

Only confirmed tracks count, and only where they were seen (a matched box, corrected by the filter), never where a
lost track is merely predicted: a prediction drifting over a line is not a crossing. A track that misses frames and
is seen again on the other side of a line is counted then, once. A zone visit ends when the track is seen outside,
when it ends (lost for max_age frames) or at a reset; dwell is measured on the frame clock while it lasts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from agent.tracking.config import LineConfig, ZoneConfig, _Shape
from agent.tracking.geometry import Point, PolygonEdges, crossing_on_segment, signed_distances
from agent.tracking.types import DWELL, LINE_CROSS, ZONE_ENTER, ZONE_LEAVE, TrackEvent


def class_name(class_id: int | None, label: str | None) -> str:
    """The name a class is counted under: its label, else its id, else "object"."""
    if label is not None:
        return label
    return "object" if class_id is None else str(class_id)


def anchor_points(boxes: np.ndarray, anchor: str) -> tuple[np.ndarray, np.ndarray]:
    """(xs, ys) of each box's anchor: its centre or the middle of its bottom edge."""
    xs = (boxes[:, 0] + boxes[:, 2]) / 2
    ys = boxes[:, 3] if anchor == "bottom_center" else (boxes[:, 1] + boxes[:, 3]) / 2
    return xs, ys


@dataclass(frozen=True)
class Observed:
    """The confirmed tracks seen in this frame, column by column."""

    ids: list[int]
    class_ids: list[int | None]
    labels: list[str | None]
    boxes: np.ndarray  # (K, 4)


def _margins(boxes: np.ndarray, hysteresis: float) -> np.ndarray:
    """The dead band around an edge for each box: a share of its height (jitter grows with the box)."""
    return hysteresis * (boxes[:, 3] - boxes[:, 1])


def _accepts(shape: _Shape, class_id: int | None, label: str | None) -> bool:
    if shape.classes is None:
        return True
    return (label is not None and label in shape.classes) or (class_id is not None and class_id in shape.classes)


def _bump(table: dict[str, int], key: str) -> None:
    table[key] = table.get(key, 0) + 1


@dataclass
class _Visit:
    since: float
    class_name: str
    dwell_sent: bool = False


class ZoneMonitor:
    """One zone: who is inside, since when, and how many entered, left and dwelled per class."""

    def __init__(self, config: ZoneConfig, polygon: Sequence[Point], camera: str) -> None:
        self.config = config
        self.polygon = np.asarray(polygon, dtype=np.float64)
        self._edges = PolygonEdges(self.polygon)
        self.camera = camera
        self.inside: dict[int, _Visit] = {}
        self.entered: dict[str, int] = {}
        self.left: dict[str, int] = {}
        self.dwelled: dict[str, int] = {}

    def observe(self, seen: Observed, ts: float, epoch: int) -> list[TrackEvent]:
        """Enter and leave events of the tracks seen, then dwell events of every visit (seen or not)."""
        events: list[TrackEvent] = []
        xs, ys = anchor_points(seen.boxes, self.config.anchor)
        within = self._edges.contains(xs, ys)
        clear = self._edges.distances(xs, ys) >= _margins(seen.boxes, self.config.hysteresis)
        inside = self.inside
        for k in np.flatnonzero(clear & (within != np.array([i in inside for i in seen.ids], dtype=bool))).tolist():
            # (on the edge, within the dead band: inside or out as before; and only a change of side matters)
            track_id = seen.ids[k]
            visit = inside.get(track_id)
            if within[k] and visit is None and _accepts(self.config, seen.class_ids[k], seen.labels[k]):
                name = class_name(seen.class_ids[k], seen.labels[k])
                self.inside[track_id] = _Visit(ts, name)
                _bump(self.entered, name)
                events.append(self._event(ZONE_ENTER, track_id, name, epoch))
            elif not within[k] and visit is not None:
                events.append(self.end(track_id, ts, epoch, "left"))
        if self.config.dwell_s is not None:
            events.extend(self._dwell(ts, epoch))
        return events

    def _dwell(self, ts: float, epoch: int) -> list[TrackEvent]:
        events = []
        for track_id, visit in self.inside.items():
            stayed = ts - visit.since
            if not visit.dwell_sent and self.config.dwell_s is not None and stayed >= self.config.dwell_s:
                visit.dwell_sent = True
                _bump(self.dwelled, visit.class_name)
                events.append(self._event(DWELL, track_id, visit.class_name, epoch, dwell_s=stayed))
        return events

    def end(self, track_id: int, ts: float, epoch: int, reason: str) -> TrackEvent:
        """The visit of `track_id` ends (it must be inside): its zone_leave event."""
        visit = self.inside.pop(track_id)
        _bump(self.left, visit.class_name)
        return self._event(ZONE_LEAVE, track_id, visit.class_name, epoch, dwell_s=ts - visit.since, reason=reason)

    def _event(self, kind: str, track_id: int, name: str, epoch: int, dwell_s: float | None = None,
               reason: str | None = None) -> TrackEvent:
        return TrackEvent(kind, self.camera, epoch, track_id=track_id, name=self.config.name, class_name=name,
                          dwell_s=dwell_s, reason=reason)

    def counts(self) -> dict[str, dict[str, int]]:
        """Per class: entered, left, inside now, dwelled (past dwell_s)."""
        inside: dict[str, int] = {}
        for visit in self.inside.values():
            _bump(inside, visit.class_name)
        return {"entered": dict(self.entered), "left": dict(self.left), "inside": inside,
                "dwelled": dict(self.dwelled)}


class LineMonitor:
    """One directed line: the side each track was last seen clearly on, and crossings per class and direction."""

    def __init__(self, config: LineConfig, ends: Sequence[Point], camera: str) -> None:
        self.config = config
        self.a, self.b = (float(ends[0][0]), float(ends[0][1])), (float(ends[1][0]), float(ends[1][1]))
        self.camera = camera
        self.sides: dict[int, tuple[int, Point]] = {}
        self.crossed: dict[str, dict[str, int]] = {"in": {}, "out": {}}

    def observe(self, seen: Observed, epoch: int) -> list[TrackEvent]:
        """line_cross events of the tracks seen on the other side of the line than before."""
        events: list[TrackEvent] = []
        xs, ys = anchor_points(seen.boxes, self.config.anchor)
        distances = signed_distances(xs, ys, self.a, self.b)
        margins = np.maximum(_margins(seen.boxes, self.config.hysteresis), 1e-9)
        clear = ~(np.abs(distances) < margins)  # within the dead band on the line, the side is what it was
        if not clear.any():
            return events
        xs_list, ys_list, positive = xs.tolist(), ys.tolist(), (distances > 0).tolist()
        for k in np.flatnonzero(clear).tolist():
            track_id = seen.ids[k]
            side = 1 if positive[k] else -1
            point = (xs_list[k], ys_list[k])
            before = self.sides.get(track_id)
            self.sides[track_id] = (side, point)
            if before is None or before[0] == side or not crossing_on_segment(before[1], point, self.a, self.b):
                continue
            direction = "in" if side > 0 else "out"
            if self.config.directions not in ("both", direction):
                continue
            if not _accepts(self.config, seen.class_ids[k], seen.labels[k]):
                continue
            name = class_name(seen.class_ids[k], seen.labels[k])
            _bump(self.crossed[direction], name)
            events.append(TrackEvent(LINE_CROSS, self.camera, epoch, track_id=track_id, name=self.config.name,
                                     class_name=name, direction=direction))
        return events

    def end(self, track_id: int) -> None:
        """Forget a track that ended."""
        self.sides.pop(track_id, None)

    def counts(self) -> dict[str, dict[str, int]]:
        """Per direction, per class."""
        return {direction: dict(per_class) for direction, per_class in self.crossed.items()}
