"""Per-camera models (docs/pipelines.md): one lane per `[models.NAME]` that a camera names, beside the agent's own
frame path, which serves `[model]` on the cameras without `model`.

A lane is a whole frame path of its own (agent.daemon.frame_path over `AgentConfig.lane_config(NAME)`): its cameras,
its batcher, its inference worker on its model, its batch size resolved from its engine's curve over its cameras,
its counters. Cameras of one model batch together; cameras of two models never share a batch (the two engines take
different inputs). The model is loaded once at start, through the agent's ModelLoader with the lane's config (the
same engine cache, gates and batch planning over the lane's cameras); a pipeline artifact serves as any model.

What acts on the serving model (deployments, rollbacks, shadows, the watch, adaptation, the live-frame sample for
the gates) acts on `[model]` alone: a lane's results reach only the consumers that do not judge `[model]` — its own
record, tracking, video and MQTT (each result naming its `model`). A lane changes by config and restart.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from agent.config.tree import AgentConfig
from agent.daemon.frame_path import FramePath
from agent.daemon.model_loading import ModelLoader
from agent.daemon.result_sinks import ResultSinks
from agent.serving.slots import LoadedModel
from engines.model.source import load_model
from kernel.errors import EdgeError

if TYPE_CHECKING:
    from agent.daemon.plane import AgentPlane
    from agent.daemon.tracking_host import TrackingHost
    from agent.video.service import VideoService

log = logging.getLogger(__name__)

Progress = Callable[[dict[str, Any]], None]


@dataclass
class ModelLane:
    """One `[models.NAME]` in use: its frame path (idle until `start`), its sinks and, once loaded, its model."""

    name: str
    config: AgentConfig  # the agent's config as this lane sees it (its cameras, its model as `model`)
    path: FramePath
    sinks: ResultSinks = field(default_factory=ResultSinks)
    loaded: LoadedModel | None = None

    @property
    def camera_names(self) -> list[str]:
        """This lane's cameras, in config order."""
        return [c.name for c in self.config.camera_list()]


class ModelLanes:
    """The lanes of one run, in the order their first camera comes; empty without `[models]`."""

    def __init__(self, config: AgentConfig, stop_event: threading.Event, emit: Callable[..., None],
                 on_camera_restart: Callable[[str], None]) -> None:
        self.stop_event = stop_event
        self.emit = emit
        self.lanes: list[ModelLane] = []
        for name in config.lane_names():
            lane_config = config.lane_config(name)
            sinks = ResultSinks()
            path = FramePath(lane_config, stop_event, emit, sinks, on_camera_restart, model_name=name)
            self.lanes.append(ModelLane(name, lane_config, path, sinks))

    def __bool__(self) -> bool:
        return bool(self.lanes)

    def views(self) -> list[ModelLane]:
        """The lanes (the live snapshot reads each one's frame path and model)."""
        return list(self.lanes)

    def load(self, index_writable: Callable[[], bool], on_progress: Progress) -> None:
        """Each lane's model from its `path`, through the engine cache and gates (a lane already loaded is kept, so a
        retry after a storage wait loads only the rest); a model that cannot be served fails the start, as a broken
        `[model]` does, with the model named."""
        for lane in self.lanes:
            if lane.loaded is not None:
                continue
            loader = ModelLoader(lane.config, self.stop_event, index_writable=index_writable)
            progress = _lane_progress(on_progress, lane.name)
            try:
                source = load_model(lane.config.models[lane.name].path)
                lane.loaded = loader.load(source, "config", on_progress=progress)
            except EdgeError as exc:
                exc.args = (f"models.{lane.name}: {exc}", *exc.args[1:])
                raise
            described = lane.loaded.describe()
            self.emit("model_loaded", model=described, origin="config", lane=lane.name, cameras=lane.camera_names)
            log.info("model %s loaded on %s (%s) for [models.%s]: camera(s) %s", lane.loaded.source.label,
                     described["backend"], described["precision"], lane.name, ", ".join(lane.camera_names))

    def start(self) -> None:
        """Each lane's cameras -> batcher -> worker (after `load`)."""
        for lane in self.lanes:
            assert lane.loaded is not None, f"models.{lane.name} was not loaded"
            lane.path.start(lane.loaded)

    def close_intake(self) -> None:
        """No more batches (first in the stop: a worker waiting for frames returns)."""
        for lane in self.lanes:
            if lane.path.batcher is not None:
                lane.path.batcher.close()

    def stop_cameras(self, timeout: float) -> None:
        """Every lane's capture threads."""
        for lane in self.lanes:
            if lane.path.cameras is not None:
                lane.path.cameras.stop(timeout)

    def join(self, timeout: float) -> None:
        """Every lane's inference loop (its last results are delivered first)."""
        for lane in self.lanes:
            worker = lane.path.worker
            if worker is not None and worker.is_alive():
                worker.join(timeout)
                if worker.is_alive():
                    log.error("the inference loop of [models.%s] did not stop within %.1f s", lane.name, timeout)

    def close(self) -> None:
        """Release every lane's model (after `join`)."""
        for lane in self.lanes:
            if lane.loaded is not None:
                lane.loaded.runtime.close()
                lane.loaded = None

    def lane_of(self, camera: str) -> ModelLane | None:
        """The lane serving `camera`; None: `[model]` serves it (or no camera has that name)."""
        return next((lane for lane in self.lanes if camera in lane.camera_names), None)

    def camera_names(self) -> list[str]:
        """Every lane's cameras."""
        return [name for lane in self.lanes for name in lane.camera_names]

    def register_sinks(self, plane: AgentPlane | None, video: VideoService | None, tracking: TrackingHost) -> None:
        """A lane's results reach what does not judge `[model]` (no adaptation, output health, live-frame sample or
        shadow): its record, tracking, video and MQTT, each result naming its model."""
        for lane in self.lanes:
            sinks = lane.sinks
            if tracking.tracking is not None:  # first, as on [model]'s path: video and MQTT read what it leaves
                sinks.add("tracking", tracking.tracking.on_result)
            sinks.add("record", lane.path.record_result)
            if video is not None:
                offer = video.offer
                sinks.add("video", lambda frame, result, runtime: offer(
                    frame.source, frame.index, frame.image, result, frame.captured_at, runtime, tracking.of(frame)))
            if plane is not None:
                sinks.add("mqtt", tracking.results_sink(plane.on_result, lane.path.head))

    def pinned(self) -> set[str]:
        """The sha256 of every lane's model, a pipeline's stage models among them: engines no collection may take."""
        pinned: set[str] = set()
        for lane in self.lanes:
            if lane.loaded is not None:
                pipeline = lane.loaded.source.manifest.pipeline
                pinned.add(lane.loaded.source.sha256)
                pinned.update(stage.model.sha256 for stage in (pipeline.stages if pipeline else []))
        return pinned

    def restart_capture(self, own: FramePath, camera: str | None) -> dict[str, Any]:
        """`restart_pipeline` over every frame path: `camera` on the one serving it, None on all of them."""
        if camera is not None:
            lane = self.lane_of(camera)
            if lane is not None:
                return lane.path.restart_capture(camera)
            if camera not in own.camera_names():
                names = own.camera_names() + self.camera_names()
                raise EdgeError(f"args.camera: no camera named {camera!r}; this agent has {', '.join(names)}",
                                code="INVALID_COMMAND")
            return own.restart_capture(camera)
        replies = [own.restart_capture(None)] + [lane.path.restart_capture(None) for lane in self.lanes]
        if not all(reply.get("restarted") for reply in replies):
            return {"restarted": False}
        return {"restarted": True, "cameras": [name for reply in replies for name in reply.get("cameras", [])]}


def _lane_progress(on_progress: Progress, name: str) -> Progress:
    """A lane's engine progress, each event naming its model (`lane`)."""
    return lambda event: on_progress({**event, "lane": name})
