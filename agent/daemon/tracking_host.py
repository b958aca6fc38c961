"""Tracking (issue #43, agent.tracking) in the running agent: started from `[tracking]` and the zones set live, fed
by a result sink, reset when a camera restarts, reporting to `status`, telemetry and the run summary.

The agent holds IDLE (agent.daemon.reporting declares it) until its start replaces it; the composition root
(agent.daemon.runner) wires it with these lines, every one a no-op while tracking is off:

    self.tracking = self.tracking.start(cfg, self.store, self.emit, self.result_sinks)  # registers its sink first
    video.offer(..., runtime, self.tracking.of(frame))   # the overlay draws ids, trails, zones, lines, counts
    sinks.add("mqtt", self.tracking.results_sink(plane.on_result, _result_head))  # track ids; results = "tracks"
    self.tracking.camera_restarted(camera)                    # ids start again in a new track_epoch, and say so
    self.tracking.stop()                                      # after the worker, before the MQTT plane

Off (the default) nothing runs: no thread, no result sink; the video sink looks up one absent key per frame.

The tracker's state is the camera's: a hot swap or an adaptation switch brings a new runtime, which changes the
parameters at most (agent.tracking.hub); only a camera restart ends the tracks. Zones and lines set with the
`set_zones` command (agent.daemon.control) are kept in the state store's key-value table under LIVE_SHAPES_KEY, a
camera's entry replacing its zones and lines from the file, and applied again at the next start.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from pydantic import ValidationError

from agent.tracking import (CameraTracking, CameraTrackingConfig, LineConfig, OutsideFrame, Tracking, TrackingConfig,
                            ZoneConfig, add_tracking, codes_of, tracked_of)
from agent.sources.synthetic import SyntheticConfig
from agent.tracking.types import TRACKING_PROBLEM, TrackedResult
from kernel.errors import EdgeError

if TYPE_CHECKING:
    from agent.config.tree import AgentConfig
    from agent.daemon.result_sinks import ResultSink
    from agent.sources.base import Frame
    from engines.postprocess import InferenceResult
    from engines.runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)

LIVE_SHAPES_KEY = "tracking_shapes"  # {camera: {"zones": [...], "lines": [...]}}: what `set_zones` set
Emit = Callable[..., None]
Send = Callable[[dict[str, Any], Callable[[], dict[str, Any]]], None]  # AgentPlane.on_result


class SinkList(Protocol):
    """Where the host registers its result sink (agent.daemon.result_sinks.ResultSinks)."""

    def add(self, name: str, sink: ResultSink) -> None:
        """Append a named sink."""
        ...


class KeyValues(Protocol):
    """What the host reads of the state store (agent.storage.state.StateStore)."""

    def get_kv_object(self, key: str) -> dict[str, Any]:
        """A stored JSON object, {} when unset."""
        ...


class TrackingHost:
    """The agent's tracking: the hub and its event thread, the zones set live, what it reports; idle (`tracking`
    None) when no camera is tracked, and then every call is a no-op (set_zones: TRACKING_OFF, status: None)."""

    def __init__(self, tracking: Tracking | None = None, config: TrackingConfig | None = None,
                 cameras: Sequence[str] = (), sizes: dict[str, tuple[int, int]] | None = None,
                 live: dict[str, dict[str, Any]] | None = None, results: str = "frames") -> None:
        self.tracking = tracking
        self.config = config or TrackingConfig()  # the file's: what `revert` goes back to
        self.cameras = list(cameras)  # every camera of the agent, tracked or not
        self._sizes = sizes or {}  # cameras whose frame size the config states (synthetic)
        self._live = live if live is not None else {}  # camera -> its zones and lines as set live (persisted)
        self._results = results  # [mqtt] results
        self._lock = threading.Lock()  # one change of shapes at a time

    def start(self, cfg: AgentConfig, store: KeyValues | None, emit: Emit, sinks: SinkList) -> "TrackingHost":
        """The agent's tracking for `cfg`: its event thread running, the zones set live in an earlier run applied,
        and its result sink added to `sinks` (first: the video and MQTT sinks read what it leaves on the frame).
        IDLE, with nothing started, when `[tracking]` tracks no camera."""
        config, cameras = cfg.tracking, [c.name for c in cfg.camera_list()]
        if not any(config.may_track(name) for name in cameras):
            return IDLE
        sizes = {c.name: (c.width, c.height) for c in cfg.camera_list() if isinstance(c, SyntheticConfig)}
        live, problems = read_live_shapes(store, config, cameras, sizes)
        tracking = Tracking.start(with_live_shapes(config, live), cameras, emit)
        assert tracking is not None  # some camera may be tracked (checked above)
        for problem in problems:
            emit(TRACKING_PROBLEM, **problem)
        sinks.add("tracking", tracking.on_result)
        return TrackingHost(tracking, config, cameras, sizes, live, cfg.mqtt.results)

    @property
    def active(self) -> bool:
        """Whether any camera is tracked (a thread and a result sink run)."""
        return self.tracking is not None

    # --- the frame path and the daemon --------------------------------------------------------------------

    @staticmethod
    def of(frame: Frame) -> TrackedResult | None:
        """The frame's tracks, zones and lines as the tracking sink left them (None: not tracked)."""
        return tracked_of(frame)

    def results_sink(self, send: Send, head: Callable[[Frame], dict[str, Any]]) -> ResultSink:
        """The MQTT results sink, with `[mqtt] results` (module function `results_sink`)."""
        return results_sink(send, head, self._results)

    def camera_restarted(self, camera: str) -> None:
        """A camera (re)opened: its tracks end, its ids start again in a new track_epoch (a tracks_reset event)."""
        if self.tracking is not None:
            self.tracking.camera_restarted(camera)

    def stop(self, timeout: float = 2.0) -> None:
        """Emit the events still queued (after the worker stopped, before the MQTT plane does)."""
        if self.tracking is not None:
            self.tracking.stop(timeout)

    # --- the set_zones command -------------------------------------------------------------------------

    def set_zones(self, camera: str, zones: list[ZoneConfig] | None, lines: list[LineConfig] | None,
                  revert: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Replace `camera`'s zones and/or lines now (`revert`: the file's again). Returns the reply and what to
        persist for the camera (None: its entry goes). EdgeError: an unknown camera (INVALID_COMMAND), one not
        tracked (TRACKING_OFF), a shape beyond its frame (TRACKING_OUTSIDE_FRAME), names used twice."""
        tracking, state = self._tracked(camera)
        with self._lock:
            current = state.shapes_config
            if revert:
                base = self.config.camera(camera)
                zones, lines = base.zones, base.lines
            try:
                new = CameraTrackingConfig(camera=camera, tracker=current.tracker,
                                           zones=current.zones if zones is None else zones,
                                           lines=current.lines if lines is None else lines)
            except ValidationError as exc:
                raise EdgeError(f"args: {_first_message(exc)}", code="INVALID_COMMAND") from None
            size = state.frame_size or self._sizes.get(camera)
            try:
                if size is not None:
                    new.check_frame(size)
                ended = tracking.set_shapes(camera, new)
            except OutsideFrame as exc:
                raise EdgeError(exc.detail, code=exc.code) from None
            entry = None if revert else shapes_entry(new)
            if entry is None:
                self._live.pop(camera, None)
            else:
                self._live[camera] = entry
        reply = {"camera": camera, "zones": [z.name for z in new.zones], "lines": [ln.name for ln in new.lines],
                 "source": "config" if revert else "live", "ended_visits": len(ended)}
        return reply, entry

    def _tracked(self, camera: str) -> tuple[Tracking, CameraTracking]:
        if self.tracking is None:
            raise EdgeError("tracking is off on this agent: zones and lines need [tracking] enabled, or a camera's "
                            "tracker.enabled (docs/tracking.md)", code="TRACKING_OFF")
        state = self.tracking.hub.camera(camera)
        if state is not None:
            return self.tracking, state
        if camera not in self.cameras:
            raise EdgeError(f"args.camera: no camera named {camera!r}; this agent has {', '.join(self.cameras)}",
                            code="INVALID_COMMAND")
        raise EdgeError(f"camera {camera!r} is not tracked: zones and lines need tracking on for it ([tracking] "
                        "enabled, or its [[tracking.cameras]] tracker.enabled; docs/tracking.md)", code="TRACKING_OFF")

    # --- what it reports ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any] | None:
        """For `status` and the run summary: per camera its epoch, tracks now, counts and the zones and lines in
        force (`source`: config or live); events per type, dropped and failed. None when idle."""
        if self.tracking is None:
            return None
        summary = self.tracking.summary()
        with self._lock:
            live = set(self._live)
        for name, numbers in summary["cameras"].items():
            state = self.tracking.hub.camera(name)
            assert state is not None
            shapes = state.shapes_config
            numbers.update(tracks=state.reported, frame_size=list(state.frame_size) if state.frame_size else None,
                           shapes={"source": "live" if name in live else "config",
                                   "zones": [z.model_dump(mode="json") for z in shapes.zones],
                                   "lines": [ln.model_dump(mode="json") for ln in shapes.lines]})
        return summary

    def telemetry(self) -> dict[str, Any] | None:
        """For each telemetry sample: per camera its epoch, tracks now and counts; events per type and dropped.
        None when idle (the sample has no `tracking`)."""
        if self.tracking is None:
            return None
        summary = self.tracking.summary()
        for name, numbers in summary["cameras"].items():
            state = self.tracking.hub.camera(name)
            numbers["tracks"] = state.reported if state is not None else 0
        return summary


IDLE = TrackingHost()  # what an agent holds before its start, and when no camera is tracked


def results_sink(send: Send, head: Callable[[Frame], dict[str, Any]], mode: str = "frames") -> ResultSink:
    """The MQTT results sink: each result's message with its tracking (`track_id` on its detections, a `tracking`
    object; agent.tracking.add_tracking), made only for the results that go out. With `[mqtt] results = "tracks"`,
    a tracked frame goes out only when its tracks changed (TrackedResult.changed); an untracked one always."""
    tracks_only = mode == "tracks"

    def sink(frame: Frame, result: InferenceResult, runtime: ModelRuntime) -> None:
        if tracks_only:
            tracked = tracked_of(frame)
            if tracked is not None and not tracked.changed:
                return
        send({"camera": frame.source},
             lambda: add_tracking({**head(frame), **result.to_dict(max_items=20)}, frame))

    return sink


def shapes_entry(config: CameraTrackingConfig) -> dict[str, Any]:
    """A camera's zones and lines as stored under LIVE_SHAPES_KEY."""
    return {"zones": [z.model_dump(mode="json") for z in config.zones],
            "lines": [ln.model_dump(mode="json") for ln in config.lines]}


def read_live_shapes(store: KeyValues | None, config: TrackingConfig, cameras: Sequence[str],
                     sizes: dict[str, tuple[int, int]]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The zones and lines set live in an earlier run that still apply, and a tracking_problem's fields for each
    that does not (a camera no longer tracked, a shape the rules or the frame size now refuse): those run with the
    file's zones."""
    if store is None:
        return {}, []
    try:
        stored = store.get_kv_object(LIVE_SHAPES_KEY)
    except sqlite3.Error as exc:  # a locked or failing store: the file's zones, said in the log
        log.error("tracking: the zones set live could not be read (%s); the config's zones are used", exc)
        return {}, []
    live: dict[str, dict[str, Any]] = {}
    problems: list[dict[str, Any]] = []
    for camera, entry in (stored.items() if isinstance(stored, dict) else ()):
        if camera not in cameras or not config.may_track(camera):
            problems.append({"camera": camera, "code": "TRACKING_OFF", "message": f"zones set live for camera "
                             f"{camera!r} are not applied: it is not tracked on this agent"})
            continue
        try:
            shapes = CameraTrackingConfig.model_validate({"camera": camera, **entry})
            if camera in sizes:
                shapes.check_frame(sizes[camera])
        except (ValidationError, OutsideFrame, TypeError) as exc:
            code = (codes_of(exc) or ["CONFIG_INVALID"])[0] if isinstance(exc, ValidationError) else \
                exc.code if isinstance(exc, OutsideFrame) else "CONFIG_INVALID"
            problems.append({"camera": camera, "code": code, "message": f"zones set live for camera {camera!r} are "
                             f"not applied (the config's are): {exc}"[:500]})
            continue
        live[camera] = shapes_entry(shapes)
    return live, problems


def with_live_shapes(config: TrackingConfig, live: dict[str, dict[str, Any]]) -> TrackingConfig:
    """`config` with each live camera's zones and lines in place of the file's."""
    if not live:
        return config
    cameras = {c.camera: c for c in config.cameras}
    for camera, entry in live.items():
        base = cameras.get(camera) or CameraTrackingConfig(camera=camera)
        cameras[camera] = CameraTrackingConfig(camera=camera, tracker=base.tracker, **entry)
    return config.model_copy(update={"cameras": list(cameras.values())})


def _first_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    return str(first["msg"]).removeprefix("Value error, ")
