"""Tracking after the detection stage (issue #43): ByteTrack per camera, zones and lines, their events and counts.

- `config`: `[tracking]` (off by default), per model and per camera; zones and lines refused with codes (`errors`).
- `tracker`: ByteTrack's three-stage association over a Kalman filter (`kalman`, `assignment`), class-aware.
- `zones`: zone_enter / zone_leave / dwell and line_cross with direction, counts per class.
- `camera`: `CameraTracking`, the state a camera owns (survives model swaps, reset on camera restart).
- `hub`: the result sink over every camera, and the thread that emits events.
See docs/tracking.md.
"""

from agent.tracking.camera import CameraTracking, detections_of
from agent.tracking.config import (CameraTrackingConfig, LineConfig, TrackerOverrides, TrackerParams, TrackingConfig,
                                   ZoneConfig)
from agent.tracking.errors import (DegenerateZone, OutsideFrame, SelfIntersectingZone, TrackingConfigError,
                                   ZeroLengthLine, codes_of)
from agent.tracking.hub import EventForwarder, Tracking, TrackingHub, add_tracking, build_tracking, tracked_of
from agent.tracking.types import EVENT_TYPES, TrackedResult, TrackEvent, TrackView

__all__ = [
    "CameraTracking", "CameraTrackingConfig", "DegenerateZone", "EVENT_TYPES", "EventForwarder", "LineConfig",
    "OutsideFrame", "SelfIntersectingZone", "TrackEvent", "TrackView", "TrackedResult", "TrackerOverrides",
    "TrackerParams", "Tracking", "TrackingConfig", "TrackingConfigError", "TrackingHub", "ZeroLengthLine", "ZoneConfig",
    "add_tracking", "build_tracking", "codes_of", "detections_of", "tracked_of",
]
