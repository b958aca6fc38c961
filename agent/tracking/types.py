"""What tracking hands on: a frame's tracks, its events, and the ids given to its detections. Plain values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ZONE_ENTER, ZONE_LEAVE, DWELL, LINE_CROSS = "zone_enter", "zone_leave", "dwell", "line_cross"
TRACKS_RESET, TRACKING_PROBLEM = "tracks_reset", "tracking_problem"
ZONES_CHANGED = "zones_changed"  # the `set_zones` command replaced a camera's zones and lines (agent.daemon.control)
EVENT_TYPES = (ZONE_ENTER, ZONE_LEAVE, DWELL, LINE_CROSS, TRACKS_RESET, TRACKING_PROBLEM, ZONES_CHANGED)
ZONE_CHANGED_REASON = "zone_changed"  # zone_leave: the zone was changed or removed live (`set_zones`)
EDGE_PX = 2.0  # a lost track whose predicted box comes this close to the frame's edge is not reported


@dataclass(frozen=True)
class TrackView:
    """One track as reported for a frame."""

    track_id: int | None  # None while tentative
    state: str  # tentative, confirmed (matched this frame), lost (box predicted)
    box: tuple[float, float, float, float]
    score: float
    class_id: int | None
    label: str | None
    age: int  # frames since the track started
    hits: int  # frames it was matched in
    misses: int  # frames since its last match
    trail: tuple[tuple[float, float], ...] = ()  # observed box centres, oldest first

    @classmethod
    def of(cls, track_id: int | None, state: str, box: tuple[float, float, float, float], score: float,
           class_id: int | None, label: str | None, age: int, hits: int, misses: int,
           trail: tuple[tuple[float, float], ...] = ()) -> "TrackView":
        """The same as the constructor, without a frozen dataclass's per-field `object.__setattr__` (a camera builds
        one view per track per frame)."""
        view = object.__new__(cls)
        view.__dict__.update(track_id=track_id, state=state, box=box, score=score, class_id=class_id, label=label,
                             age=age, hits=hits, misses=misses, trail=trail)
        return view

    def to_dict(self, trail: bool = False) -> dict[str, Any]:
        """Compact JSON form (the result message's `tracks`)."""
        out: dict[str, Any] = {"id": self.track_id, "state": self.state, "box": [round(v, 1) for v in self.box],
                               "score": round(self.score, 4), "age": self.age, "hits": self.hits}
        if self.misses:
            out["misses"] = self.misses
        if self.class_id is not None:
            out["class_id"] = self.class_id
        if self.label is not None:
            out["label"] = self.label
        if trail:
            out["trail"] = [[round(x, 1), round(y, 1)] for x, y in self.trail]
        return out


@dataclass(frozen=True)
class TrackEvent:
    """A zone, line or reset event of one camera; `fields()` is what goes with the event's type on the wire."""

    type: str
    camera: str
    epoch: int
    track_id: int | None = None
    name: str | None = None  # the zone or line
    class_name: str | None = None
    direction: str | None = None  # line_cross: "in" or "out"
    dwell_s: float | None = None  # dwell and zone_leave: time inside
    reason: str | None = None  # zone_leave ("left", "track_ended", "reset"), tracks_reset
    code: str | None = None  # tracking_problem
    message: str | None = None  # tracking_problem
    ended_tracks: int | None = None  # tracks_reset

    def fields(self) -> dict[str, Any]:
        """The event's fields (those set), `type` left out. `track_epoch`, not `epoch`: an event's envelope already
        has an `epoch` (its outbox stream's, docs/mqtt.md)."""
        out: dict[str, Any] = {"camera": self.camera, "track_epoch": self.epoch}
        optional = (("track_id", self.track_id), ("class", self.class_name), ("direction", self.direction),
                    ("reason", self.reason), ("code", self.code), ("message", self.message),
                    ("ended_tracks", self.ended_tracks))
        out.update((key, value) for key, value in optional if value is not None)
        if self.name is not None:
            out["line" if self.type == LINE_CROSS else "zone"] = self.name
        if self.dwell_s is not None:
            out["dwell_s"] = round(self.dwell_s, 2)
        return out


@dataclass(frozen=True)
class ShapeView:
    """A zone or line as drawn: its corners (a zone) or ends (a line) in frame pixels, and its counts as text."""

    kind: str  # "zone" or "line"
    name: str
    points: tuple[tuple[float, float], ...]
    counts: str  # e.g. "2 inside, 7 entered" or "in 4, out 1"


@dataclass
class TrackedResult:
    """One frame of one camera after tracking."""

    camera: str
    epoch: int  # counts the camera's resets: ids are unique within an epoch
    ts: float
    tracks: list[TrackView] = field(default_factory=list)
    events: list[TrackEvent] = field(default_factory=list)
    detection_ids: list[int | None] = field(default_factory=list)  # per input detection, in order
    coast_frames: int = 0
    frame_size: tuple[int, int] | None = None  # width, height
    # the reported tracks (ids and states) or the epoch differ from the camera's previous frame, or there are events:
    # what `[mqtt] results = "tracks"` sends
    changed: bool = True
    shapes: tuple[ShapeView, ...] = ()  # the camera's zones and lines with their counts (the video overlay)

    def reported(self) -> list[TrackView]:
        """The tracks a consumer sees: confirmed ones, and lost ones for coast_frames after their last match while
        their predicted box is clear of the frame's edges (a box cut by the edge is an object leaving: the detector
        clipped it, so its prediction lags behind the object and would be a false box)."""
        return [t for t in self.tracks if t.state == "confirmed"
                or (t.state == "lost" and t.misses <= self.coast_frames and self._clear_of_edges(t.box))]

    def _clear_of_edges(self, box: tuple[float, float, float, float]) -> bool:
        if self.frame_size is None:
            return True
        width, height = self.frame_size
        return box[0] > EDGE_PX and box[1] > EDGE_PX and box[2] < width - EDGE_PX and box[3] < height - EDGE_PX

    def to_dict(self, trail: bool = False) -> dict[str, Any]:
        """The `tracking` object of a result message."""
        return {"track_epoch": self.epoch, "tracks": [t.to_dict(trail) for t in self.reported()],
                "events": [{"type": e.type, **e.fields()} for e in self.events]}
