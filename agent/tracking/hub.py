"""The agent's tracking: one CameraTracking per camera, fed by a result sink, with events handed to a thread.

`build_tracking` returns None when no camera can be tracked (the default), and then the agent registers nothing:
off costs nothing. The sink (`TrackingHub.on_result`, a `(frame, result, runtime)` callable for
agent.daemon.result_sinks) runs on the results thread: it tracks the frame, leaves the TrackedResult in
`frame.meta["tracking"]` for the sinks after it (MQTT results, the video overlay), and hands events to the
EventForwarder, whose own thread stores and publishes them, so a burst of crossings never waits on SQLite.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from agent.tracking.camera import CameraTracking
from agent.tracking.config import CameraTrackingConfig, TrackingConfig
from agent.tracking.types import TrackedResult, TrackEvent

if TYPE_CHECKING:
    from engines.postprocess import InferenceResult
    from engines.runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)
META_KEY = "tracking"  # where the sink leaves the frame's TrackedResult
Emit = Callable[..., None]  # emit(type, **fields): the agent's event function


class FrameLike(Protocol):
    """What the sink reads of a frame (agent.sources.base.Frame)."""

    source: str
    captured_at: float
    meta: dict

    @property
    def image(self) -> np.ndarray:
        """The frame's pixels (their shape is the frame size)."""
        ...


def model_name(runtime: "ModelRuntime | None") -> str | None:
    """The serving model's manifest name ([tracking.models] key)."""
    return None if runtime is None else runtime.source.manifest.name


class TrackingHub:
    """Every tracked camera's state, and the result sink that feeds it."""

    def __init__(self, config: TrackingConfig, cameras: Sequence[str],
                 on_events: Callable[[list[TrackEvent]], None] | None = None) -> None:
        self.config = config
        self._cameras = {name: CameraTracking(name, config.params(name), config.camera(name))
                         for name in cameras if config.may_track(name)}
        self._on_events = on_events
        self._serving: dict[str, tuple[object, bool]] = {}  # camera -> (runtime, tracked with it)
        self._counted: Counter[str] = Counter()  # events handed on, per type (telemetry, Prometheus)
        self._count_lock = threading.Lock()  # events come from the results, capture and command threads

    @property
    def cameras(self) -> list[str]:
        """The cameras with tracking state."""
        return list(self._cameras)

    def camera(self, name: str) -> CameraTracking | None:
        """One camera's state (None: not tracked)."""
        return self._cameras.get(name)

    def on_result(self, frame: FrameLike, result: "InferenceResult", runtime: "ModelRuntime | None") -> None:
        """The result sink: track the frame when its camera and model are tracked."""
        tracking = self._cameras.get(frame.source)
        if tracking is None or not self._tracked_with(tracking, runtime):
            return
        height, width = frame.image.shape[:2]
        tracked = tracking.update(result.detections, frame.captured_at, (width, height))
        frame.meta[META_KEY] = tracked
        if tracked.events:
            self._hand_on(tracked.events)

    def _hand_on(self, events: list[TrackEvent]) -> None:
        with self._count_lock:
            self._counted.update(event.type for event in events)
        if self._on_events is not None:
            self._on_events(events)

    def event_counts(self) -> dict[str, int]:
        """Events handed on since the start, per type."""
        with self._count_lock:
            return dict(self._counted)

    def _tracked_with(self, tracking: CameraTracking, runtime: object) -> bool:
        """Whether this runtime's results are tracked on this camera; the parameters follow a model change."""
        serving = self._serving.get(tracking.camera)
        if serving is not None and serving[0] is runtime:
            return serving[1]
        name = model_name(runtime)  # type: ignore[arg-type]  # the serving ModelRuntime, `object` at this seam
        tracked = self.config.tracked(tracking.camera, name)
        if tracked:
            tracking.configure(self.config.params(tracking.camera, name))
        self._serving[tracking.camera] = (runtime, tracked)
        return tracked

    def reset(self, camera: str, reason: str) -> list[TrackEvent]:
        """The camera restarted: end its tracks (events handed on as well as returned); [] for an untracked one."""
        tracking = self._cameras.get(camera)
        events = tracking.reset(reason) if tracking is not None else []
        if events:
            self._hand_on(events)
        return events

    def set_shapes(self, camera: str, config: CameraTrackingConfig) -> list[TrackEvent]:
        """Replace a tracked camera's zones and lines now (KeyError: not tracked; OutsideFrame: a pixel shape
        beyond the frames seen, nothing changed); the events of the visits it ended are handed on and returned."""
        events = self._cameras[camera].set_shapes(config)
        if events:
            self._hand_on(events)
        return events

    def counts(self) -> dict[str, Any]:
        """Per camera: epoch and counts per zone and line (the run summary, `status`)."""
        return {name: tracking.counts() for name, tracking in self._cameras.items()}


def tracked_of(frame: FrameLike) -> TrackedResult | None:
    """The TrackedResult the sink left on a frame (for the sinks after it)."""
    found = frame.meta.get(META_KEY)
    return found if isinstance(found, TrackedResult) else None


def add_tracking(payload: dict[str, Any], frame: FrameLike) -> dict[str, Any]:
    """A result message (`InferenceResult.to_dict()`, its detections in the result's order) with the frame's
    tracking: a `track_id` on each tracked detection and a `tracking` object (track_epoch, reported tracks, this
    frame's events). Unchanged when the frame was not tracked."""
    tracked = tracked_of(frame)
    if tracked is None:
        return payload
    for detection, track_id in zip(payload.get("detections", ()), tracked.detection_ids):
        if track_id is not None:
            detection["track_id"] = track_id
    payload["tracking"] = tracked.to_dict()
    return payload


def build_tracking(config: TrackingConfig, cameras: Sequence[str],
                   on_events: Callable[[list[TrackEvent]], None] | None = None) -> TrackingHub | None:
    """The hub, or None when no camera can be tracked (then register no sink at all)."""
    if not any(config.may_track(name) for name in cameras):
        return None
    return TrackingHub(config, cameras, on_events)


class EventForwarder:
    """A bounded queue of tracking events and the thread that emits them (`emit(type, **fields)`); when the queue
    is full the oldest event is dropped and counted, the results thread never waits."""

    def __init__(self, emit: Emit, capacity: int = 1000, name: str = "tracking-events") -> None:
        self._emit = emit
        self._queue: deque[TrackEvent] = deque()
        self._capacity = capacity
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.dropped = 0
        self.failed = 0

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def offer(self, events: Sequence[TrackEvent]) -> None:
        """Queue events (never blocks)."""
        with self._lock:
            for event in events:
                if len(self._queue) >= self._capacity:
                    self._queue.popleft()
                    self.dropped += 1
                self._queue.append(event)
        self._wake.set()

    def stop(self, timeout: float = 2.0) -> None:
        """Emit what is queued, then end the thread (within `timeout`)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            self._drain()
            if self._stop.is_set():
                self._drain()
                return

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                event = self._queue.popleft()
            try:
                self._emit(event.type, **event.fields())
            except Exception:  # one event that cannot be emitted never stops the others
                self.failed += 1
                if self.failed == 1 or self.failed % 1000 == 0:  # the first, then a count: never a flood
                    log.exception("tracking event %s could not be emitted (%d so far)", event.type, self.failed)


class Tracking:
    """The hub and its event thread as one part, for the daemon to start, feed, reset and stop."""

    def __init__(self, hub: TrackingHub, events: EventForwarder) -> None:
        self.hub = hub
        self.events = events

    @classmethod
    def start(cls, config: TrackingConfig, cameras: Sequence[str], emit: Emit) -> "Tracking | None":
        """Tracking with its event thread running, or None (nothing started) when no camera can be tracked."""
        events = EventForwarder(emit, config.event_queue)
        hub = build_tracking(config, cameras, events.offer)
        if hub is None:
            return None
        events.start()
        return cls(hub, events)

    def on_result(self, frame: FrameLike, result: "InferenceResult", runtime: "ModelRuntime | None") -> None:
        """The result sink (agent.daemon.result_sinks): register it before the sinks that read the tracking."""
        self.hub.on_result(frame, result, runtime)

    def camera_restarted(self, camera: str) -> None:
        """A camera (re)opened: its tracks end and its ids start again (said by a tracks_reset event)."""
        self.hub.reset(camera, "camera_restarted")

    def set_shapes(self, camera: str, config: CameraTrackingConfig) -> list[TrackEvent]:
        """A camera's zones and lines, live (TrackingHub.set_shapes)."""
        return self.hub.set_shapes(camera, config)

    def summary(self) -> dict[str, Any]:
        """For the run summary and `status`: counts per camera, events per type, and events dropped or failed."""
        return {"cameras": self.hub.counts(), "events": self.hub.event_counts(), "events_dropped": self.events.dropped,
                "events_failed": self.events.failed}

    def stop(self, timeout: float = 2.0) -> None:
        """Emit the events still queued, then end the event thread."""
        self.events.stop(timeout)
