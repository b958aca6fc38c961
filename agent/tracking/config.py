"""`[tracking]`: the tracker's parameters (everywhere, per model, per camera), and each camera's zones and lines.

Off by default: with `enabled = false` and no camera switching it on, `build_tracking` returns None and the agent
registers no result sink, so tracking costs nothing. Parameters merge in this order, later wins: the defaults,
`[tracking.tracker]`, `[tracking.models.<model name>]`, the camera's own `tracker` table. The tracker's state
belongs to the camera, never to the model: a model swap changes the parameters at most, never the ids.
"""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.base.names import CAMERA_NAME_PATTERN
from agent.tracking.errors import DegenerateZone, OutsideFrame, SelfIntersectingZone, ZeroLengthLine
from agent.tracking.geometry import Point, on_one_line, self_intersection

NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_CORNERS = 256  # a zone's corners: the simple-polygon check is quadratic, and a command is checked on arrival
MAX_SHAPES = 64  # zones, and lines, per camera
Coords = Literal["pixels", "normalized"]
Anchor = Literal["center", "bottom_center"]


class TrackerParams(BaseModel):
    """ByteTrack's association with a constant-velocity Kalman filter (docs/tracking.md)."""

    model_config = ConfigDict(extra="forbid")

    high_score: float = Field(0.5, gt=0, le=1, description="Detections scoring at least this take part in the "
                              "first association (with every confirmed and lost track) and may start tracks.")
    low_score: float = Field(0.1, ge=0, le=1, description="Detections between this and high_score are matched in a "
                             "second stage, only to confirmed tracks the first stage left (ByteTrack's recovery of "
                             "occluded, blurred objects); below it they are ignored.")
    new_track_score: float = Field(0.6, gt=0, le=1, description="A high detection no track takes starts a "
                                   "tentative track when it scores at least this.")
    match_iou: float = Field(0.2, gt=0, le=1, description="First stage: least IoU (times the detection's score "
                             "with fuse_score) between a track's predicted box and a detection.")
    low_match_iou: float = Field(0.5, gt=0, le=1, description="Second stage: least IoU for a low detection.")
    tentative_match_iou: float = Field(0.3, gt=0, le=1, description="Least IoU (fused like match_iou) that keeps "
                                       "a tentative track going.")
    fuse_score: bool = Field(True, description="Weigh IoU by the detection's score in the first and tentative "
                             "stages (ByteTrack's fuse_score), so a confident box wins a close tie.")
    min_hits: int = Field(2, ge=1, le=100, description="Matches in a row before a tentative track is confirmed and "
                          "gets its id (1: at once).")
    max_age: int = Field(30, ge=0, le=10_000, description="Frames a confirmed track survives without a match (state "
                         "lost, its box predicted) before it ends; matched again in time, it keeps its id.")
    coast_frames: int = Field(3, ge=0, le=1000, description="A lost track is still reported, with its predicted "
                              "box, for this many frames (bridges single missed detections); it lives on unreported "
                              "until max_age.")
    class_aware: bool = Field(True, description="Match a track only to detections of its own class (the label when "
                              "the model has labels, else the class id), so a swap to a model with another class "
                              "order keeps matching by name.")
    trail_length: int = Field(30, ge=0, le=1000, description="Observed positions (box centres) a track keeps.")

    @model_validator(mode="after")
    def _scores_ordered(self) -> "TrackerParams":
        if self.low_score > self.high_score:
            raise ValueError(f"low_score {self.low_score} is above high_score {self.high_score}")
        return self


class TrackerOverrides(BaseModel):
    """Some of TrackerParams' fields, for a model or a camera; unset ones come from the level above."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = Field(None, description="Track (true) or not (false); unset: the level above decides.")
    high_score: float | None = Field(None, gt=0, le=1, description="See [tracking.tracker] high_score.")
    low_score: float | None = Field(None, ge=0, le=1, description="See [tracking.tracker] low_score.")
    new_track_score: float | None = Field(None, gt=0, le=1, description="See [tracking.tracker] new_track_score.")
    match_iou: float | None = Field(None, gt=0, le=1, description="See [tracking.tracker] match_iou.")
    low_match_iou: float | None = Field(None, gt=0, le=1, description="See [tracking.tracker] low_match_iou.")
    tentative_match_iou: float | None = Field(None, gt=0, le=1, description="See [tracking.tracker] "
                                              "tentative_match_iou.")
    fuse_score: bool | None = Field(None, description="See [tracking.tracker] fuse_score.")
    min_hits: int | None = Field(None, ge=1, le=100, description="See [tracking.tracker] min_hits.")
    max_age: int | None = Field(None, ge=0, le=10_000, description="See [tracking.tracker] max_age.")
    coast_frames: int | None = Field(None, ge=0, le=1000, description="See [tracking.tracker] coast_frames.")
    class_aware: bool | None = Field(None, description="See [tracking.tracker] class_aware.")
    trail_length: int | None = Field(None, ge=0, le=1000, description="See [tracking.tracker] trail_length.")

    def apply(self, params: TrackerParams) -> TrackerParams:
        """`params` with the fields set here replaced (checked again: low_score <= high_score)."""
        changes = self.model_dump(exclude_none=True, exclude={"enabled"})
        return TrackerParams(**{**params.model_dump(), **changes}) if changes else params


def _check_points(points: Sequence[Point], coords: Coords, what: str) -> None:
    for x, y in points:
        if coords == "normalized" and not (0 <= x <= 1 and 0 <= y <= 1):
            raise OutsideFrame(f"{what}: point ({x}, {y}) is outside the frame (normalized coordinates run 0..1)")
        if coords == "pixels" and (x < 0 or y < 0):
            raise OutsideFrame(f"{what}: point ({x}, {y}) is outside the frame (pixels start at 0)")


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="Name in events and counts, unique among the camera's "
                      "zones and lines.")
    coords: Coords = Field("pixels", description="\"pixels\" of the camera's frame, or \"normalized\": 0..1 of its "
                           "width and height (the same zone at any resolution).")
    classes: list[str | int] | None = Field(None, description="Only these classes count: labels, or class ids for a "
                                            "model without labels; unset: every class.")
    anchor: Anchor = Field("bottom_center", description="The point of a box that must be inside a zone or cross a "
                           "line: \"bottom_center\" (where a person or car stands) or \"center\".")
    hysteresis: float = Field(0.1, ge=0, le=2, description="How far past the edge (a share of the box's height) the "
                              "anchor must be before the track counts as inside, outside or across: a box jittering "
                              "on the edge enters or crosses once, not every other frame.")

    def pixels(self, points: Sequence[Point], size: tuple[int, int]) -> list[Point]:
        """`points` in pixels of a `size` (width, height) frame; OutsideFrame when a pixel point lies beyond it."""
        width, height = size
        if self.coords == "normalized":
            return [(x * width, y * height) for x, y in points]
        for x, y in points:
            if x > width or y > height:
                raise OutsideFrame(f"{self._what()}: point ({x}, {y}) is outside the {width}x{height} frame")
        return list(points)

    def _what(self) -> str:
        return f"{type(self).__name__.removesuffix('Config').lower()} {self.name!r}"


class ZoneConfig(_Shape):
    """A polygon; events when a track's anchor enters it, leaves it, or stays longer than dwell_s."""

    polygon: list[tuple[float, float]] = Field(max_length=MAX_CORNERS, description="Corners in order, at least "
                                               "three and at most 256: [[x, y], ...]; the edges may not cross (a "
                                               "simple polygon).")
    dwell_s: float | None = Field(None, gt=0, le=86_400, description="A `dwell` event, once per visit, when a track "
                                  "has been inside this long; unset: no dwell events.")

    @model_validator(mode="after")
    def _simple_polygon(self) -> "ZoneConfig":
        what = self._what()
        _check_points(self.polygon, self.coords, what)
        corners = self.polygon
        if len(corners) < 3 or len(set(corners)) < 3:
            raise DegenerateZone(f"{what}: a zone needs at least three distinct corners, got {len(set(corners))}")
        repeated = next((i for i in range(len(corners)) if corners[i] == corners[(i + 1) % len(corners)]), None)
        if repeated is not None:
            raise DegenerateZone(f"{what}: corner {repeated} repeats the next one")
        if on_one_line(corners):
            raise DegenerateZone(f"{what}: the polygon has no area (its corners are on one line)")
        crossing = self_intersection(corners)
        if crossing is not None:
            raise SelfIntersectingZone(f"{what}: edges {crossing[0]} and {crossing[1]} cross or touch; list the "
                                       "corners in order around the zone")
        return self


class LineConfig(_Shape):
    """A directed segment; `line_cross` events with direction "in" (from its left to its right, walking from the
    first point to the second; a line drawn left to right counts downward moves as in) or "out"."""

    points: tuple[tuple[float, float], tuple[float, float]] = Field(description="The two ends: [[x1, y1], [x2, y2]].")
    directions: Literal["both", "in", "out"] = Field("both", description="Which crossings count and raise events.")

    @model_validator(mode="after")
    def _has_length(self) -> "LineConfig":
        _check_points(self.points, self.coords, self._what())
        (x1, y1), (x2, y2) = self.points
        if x1 == x2 and y1 == y2:
            raise ZeroLengthLine(f"{self._what()}: both ends are ({x1}, {y1}); a line needs two distinct points")
        return self


class CameraTrackingConfig(BaseModel):
    """One camera's tracking: whether, with which parameters, and its zones and lines."""

    model_config = ConfigDict(extra="forbid")

    camera: str = Field(pattern=CAMERA_NAME_PATTERN, description="The camera's name ([[cameras]] name).")
    tracker: TrackerOverrides = Field(default_factory=TrackerOverrides, description="This camera's parameters "
                                      "(and `enabled`), over [tracking.tracker] and the model's.")
    zones: list[ZoneConfig] = Field(default_factory=list, max_length=MAX_SHAPES, description="Polygons (at most 64): "
                                    "zone_enter, zone_leave, dwell.")
    lines: list[LineConfig] = Field(default_factory=list, max_length=MAX_SHAPES, description="Directed lines (at most "
                                    "64): line_cross in/out.")

    @model_validator(mode="after")
    def _unique_names(self) -> "CameraTrackingConfig":
        seen: set[str] = set()
        for shape in [*self.zones, *self.lines]:
            if shape.name in seen:
                raise ValueError(f"camera {self.camera!r}: the name {shape.name!r} is used twice among its zones "
                                 "and lines")
            seen.add(shape.name)
        return self

    def check_frame(self, size: tuple[int, int]) -> None:
        """OutsideFrame for the first pixel zone or line that does not fit a `size` (width, height) frame (for a
        config check where the camera's resolution is known; the agent checks again at its first frame)."""
        for zone in self.zones:
            zone.pixels(zone.polygon, size)
        for line in self.lines:
            line.pixels(line.points, size)


class TrackingConfig(BaseModel):
    """`[tracking]`: a tracker after the detection stage, per camera."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Track every camera (a camera's `tracker.enabled` or a model's can "
                          "still say otherwise). Off, and no camera on: nothing runs at all.")
    tracker: TrackerParams = Field(default_factory=TrackerParams, description="Parameters for every camera and model.")
    models: dict[str, TrackerOverrides] = Field(default_factory=dict, description="Per model (its manifest name): "
                                                "parameters over [tracking.tracker]; enabled = false: that model's "
                                                "results are not tracked (a classifier).")
    cameras: list[CameraTrackingConfig] = Field(default_factory=list, description="Per camera: parameters, zones "
                                                "and lines.")
    event_queue: int = Field(1000, ge=1, le=100_000, description="Tracking events waiting for the event thread; "
                             "beyond it the oldest are dropped and counted.")

    @field_validator("cameras")
    @classmethod
    def _one_entry_per_camera(cls, cameras: list[CameraTrackingConfig]) -> list[CameraTrackingConfig]:
        names = [c.camera for c in cameras]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"cameras listed twice: {', '.join(twice)}")
        return cameras

    @model_validator(mode="after")
    def _levels_merge(self) -> "TrackingConfig":
        """Every camera with every model gives valid parameters (low_score <= high_score once merged)."""
        for model in [None, *self.models]:
            for camera in [None, *self.cameras]:
                try:
                    self._merged(camera, model)
                except ValidationError as exc:
                    where = " and ".join(filter(None, [f"models.{model}" if model else "",
                                                       f"camera {camera.camera!r}" if camera else ""]))
                    problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                    raise ValueError(f"tracking parameters of {where or 'tracker'}: {problems}") from None
        return self

    def camera(self, name: str) -> CameraTrackingConfig:
        """The camera's entry (an empty one when it has none)."""
        return next((c for c in self.cameras if c.camera == name), None) or CameraTrackingConfig(camera=name)

    def check_cameras(self, names: Sequence[str]) -> None:
        """ValueError naming entries for cameras the agent does not have (AgentConfig's cross-field rule)."""
        unknown = [c.camera for c in self.cameras if c.camera not in names]
        if unknown:
            raise ValueError(f"tracking.cameras: no camera named {', '.join(map(repr, unknown))}; this agent has "
                             f"{', '.join(names)}")

    def tracked(self, camera: str, model: str | None = None) -> bool:
        """Whether frames of `camera` served by `model` are tracked."""
        enabled = self.enabled
        for level in (self.models.get(model) if model else None, self.camera(camera).tracker):
            if level is not None and level.enabled is not None:
                enabled = level.enabled
        return enabled

    def may_track(self, camera: str) -> bool:
        """Whether any model could have `camera` tracked (decides if the camera gets tracking state at all)."""
        return self.tracked(camera) or any(
            m.enabled and self.camera(camera).tracker.enabled is not False for m in self.models.values())

    def params(self, camera: str, model: str | None = None) -> TrackerParams:
        """The parameters for `camera` served by `model` (defaults < tracker < model < camera)."""
        return self._merged(next((c for c in self.cameras if c.camera == camera), None), model)

    def _merged(self, camera: CameraTrackingConfig | None, model: str | None) -> TrackerParams:
        params = self.tracker
        overrides = self.models.get(model) if model else None
        if overrides is not None:
            params = overrides.apply(params)
        return camera.tracker.apply(params) if camera is not None else params
