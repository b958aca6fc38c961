"""What the running agent says about itself, read once per tick: one `LiveSnapshot` that `status`, the live record
(`edge-agent status` from another process), telemetry (and Prometheus, which reads the telemetry sample) and the
run summary all take their numbers from, each in its own wire shape (docs/contract.md).

Before, each of the four read the frame path on its own and wrote the numbers out by hand; now the frame path's
counters are read in one place (`LiveReport.live_snapshot`), so the shapes cannot drift apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from agent.pipeline.summary import batch_numbers, camera_numbers, capture_totals

if TYPE_CHECKING:
    from agent.adapt.controller import AdaptController
    from agent.daemon.frame_path import FramePath
    from agent.daemon.result_sinks import ResultSinks
    from agent.daemon.tracking_host import TrackingHost
    from agent.pipeline.live_frame_sampler import LiveFrameSampler
    from agent.shadow.session import ShadowSession
    from agent.serving.slots import LoadedModel
    from agent.storage.health import StorageHealth
    from agent.video.service import VideoService

Numbers = dict[str, Any]


@dataclass(frozen=True)
class LiveSnapshot:
    """The live numbers of one moment. Frame-path counters are since the start (`latency_ms`, `stages_ms`) or since
    the serving model's first result (`window_*`); each other part's state is its own report, None while it is not
    running (`*_telemetry`: the compact form telemetry carries)."""

    ts: float  # time.time()
    monotonic: float  # time.monotonic() of the same moment (telemetry's intervals)
    health: str  # online, degraded or updating
    frames: int
    fps: float  # since the start
    recent_fps: float  # delivered over the last 5 s
    dropped_frames: int
    errors: int
    latency_ms: Numbers
    stages_ms: Numbers
    window_latency_ms: Numbers
    window_stages_ms: Numbers
    model: Numbers  # {} before a model serves
    result_sink_errors: dict[str, int]
    camera: dict[str, int]  # capture counters of all cameras added up
    cameras: dict[str, Numbers]  # per camera (agent.pipeline.summary.camera_numbers)
    batch: Numbers | None  # the size in use, why, and the worker's batch status
    batch_live: Numbers | None  # the size in use and its live curve (telemetry, Prometheus)
    deployment: Numbers | None
    adapt: Numbers | None
    adapt_telemetry: Numbers | None
    live_frames: Numbers | None
    video: Numbers | None
    shadow: Numbers | None  # a shadow deployment's report
    shadow_telemetry: Numbers | None  # the same, compact, only while it runs
    tracking: Numbers | None
    tracking_telemetry: Numbers | None
    storage: Numbers
    storage_failing: bool  # a state write has failed since the start
    last_results: list[Numbers]
    duration_s: float
    models: dict[str, Numbers] | None = None  # each [models.NAME] lane's numbers; None: no [models] in use

    def summary(self) -> dict[str, Any]:
        """The run summary of docs/contract.md, with `cameras` per camera and the batch size in use."""
        return {
            "frames": self.frames, "fps": self.fps, "dropped_frames": self.dropped_frames,
            "latency_ms": self.latency_ms, "stages_ms": self.stages_ms, "model": self.model, "errors": self.errors,
            "result_sink_errors": self.result_sink_errors, "camera": self.camera, "cameras": self.cameras,
            "batch": self.batch, "adapt": self.adapt, "live_frames": self.live_frames, "video": self.video,
            "shadow": self.shadow,  # a shadow deployment running
            "tracking": self.tracking,  # None while off; per camera counts, zones (docs/tracking.md)
            "last_results": self.last_results, "duration_s": self.duration_s, **self._models(),
        }

    def _models(self) -> dict[str, Any]:
        """`models` where `[models.NAME]` serve cameras; absent otherwise (the top-level numbers are [model]'s)."""
        return {"models": self.models} if self.models is not None else {}

    def live_record(self) -> dict[str, Any]:
        """The record `edge-agent status` reads from the state store (agent.storage.state.LIVE_KEY)."""
        return {
            "ts": self.ts, "state": self.health, "fps": self.fps, "frames": self.frames,
            "dropped_frames": self.dropped_frames, "latency_ms": self.latency_ms,
            "window_latency_ms": self.window_latency_ms, "errors": self.errors, "model": self.model,
            "cameras": self.cameras, "batch": self.batch, "deployment": self.deployment, "adapt": self.adapt,
            "storage": self.storage, "video": self.video, "shadow": self.shadow, "tracking": self.tracking,
            **self._models(),
        }


class LiveSource(Protocol):
    """What telemetry and `status` read of the running agent: one snapshot per call."""

    def live_snapshot(self) -> LiveSnapshot:
        """The live numbers now."""
        ...


class LaneView(Protocol):
    """What the snapshot reads of one `[models.NAME]` lane (agent.daemon.model_lanes.ModelLane)."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> FramePath: ...

    @property
    def loaded(self) -> LoadedModel | None: ...


def _no_lanes() -> Sequence[LaneView]:
    return ()


@dataclass(frozen=True)
class LiveParts:
    """How the snapshot reaches the parts made after it (each None, or idle, while it is not running): one call
    each, so the snapshot sees what runs now, not what ran when it was wired."""

    active: Callable[[], LoadedModel | None]
    deployment: Callable[[], Numbers | None]  # the deployment manager's status
    adapt: Callable[[], AdaptController | None]
    shadow: Callable[[], ShadowSession | None]
    live_frames: Callable[[], LiveFrameSampler | None]
    video: Callable[[], VideoService | None]
    tracking: Callable[[], TrackingHost]
    lanes: Callable[[], Sequence[LaneView]] = field(default=_no_lanes)  # the [models.NAME] lanes (config order)


class LiveReport:
    """Takes the live snapshot: the frame path's counters once, then each running part's own report."""

    def __init__(self, frame_path: FramePath, storage: StorageHealth, result_sinks: ResultSinks,
                 parts: LiveParts) -> None:
        self.frame_path, self.storage, self.result_sinks, self.parts = frame_path, storage, result_sinks, parts

    def live_snapshot(self) -> LiveSnapshot:
        """The live numbers now (each part read once, so health and deployment agree within one snapshot)."""
        path, parts, storage = self.frame_path, self.parts, self.storage
        stats, worker, batcher, cameras = path.stats, path.worker, path.batcher, path.cameras
        window = worker.window if worker is not None else None
        deployment = parts.deployment()
        active, adapt, shadow, tracking = parts.active(), parts.adapt(), parts.shadow(), parts.tracking()
        live_frames, video = parts.live_frames(), parts.video()
        lanes = parts.lanes()
        now = time.monotonic()
        return LiveSnapshot(
            ts=time.time(), monotonic=now, health=_health(path, storage, deployment, [lane.path for lane in lanes]),
            frames=stats.frames, fps=round(stats.fps(), 2), recent_fps=path.recent_fps(),
            dropped_frames=batcher.dropped if batcher is not None else 0, errors=stats.errors,
            latency_ms=stats.latency.summary(), stages_ms=stats.stage_means(),
            window_latency_ms=window.latency.summary() if window is not None else {},
            window_stages_ms=window.stage_means() if window is not None else {},
            model=active.describe() if active is not None else {}, result_sink_errors=self.result_sinks.errors(),
            camera=capture_totals(cameras), cameras=camera_numbers(worker, batcher, cameras),
            batch=_batch_summary(path), batch_live=batch_numbers(worker), deployment=deployment,
            adapt=adapt.status() if adapt is not None else None,
            adapt_telemetry=adapt.telemetry() if adapt is not None else None,
            live_frames=live_frames.stats() if live_frames is not None else None,
            video=video.status() if video is not None else None,
            shadow=shadow.report() if shadow is not None else None,
            shadow_telemetry=shadow.telemetry() if shadow is not None and not shadow.done else None,
            tracking=tracking.status(), tracking_telemetry=tracking.telemetry(),
            storage=storage.status(), storage_failing=bool(storage.failures),
            last_results=path.recent_results(), duration_s=round(now - stats.started, 2),
            models={lane.name: lane_numbers(lane.path, lane.loaded) for lane in lanes} if lanes else None)


def lane_numbers(path: FramePath, loaded: LoadedModel | None) -> Numbers:
    """One `[models.NAME]` lane in the snapshot: its model, cameras, batch size and counters since its start."""
    stats, worker, batcher = path.stats, path.worker, path.batcher
    return {"model": loaded.describe() if loaded is not None else {},
            "label": loaded.source.label if loaded is not None else None,
            "cameras": camera_numbers(worker, batcher, path.cameras), "batch": _batch_summary(path),
            "frames": stats.frames, "fps": round(stats.fps(), 2), "recent_fps": path.recent_fps(),
            "dropped_frames": batcher.dropped if batcher is not None else 0, "errors": stats.errors,
            "latency_ms": stats.latency.summary(), "degraded": _path_degraded(path)}


def _path_degraded(path: FramePath) -> bool:
    """Inference failing, or a camera lost and not back."""
    if path.worker is not None and path.worker.degraded:
        return True
    return path.cameras is not None and bool(path.cameras.any_lost())


def _health(path: FramePath, storage: StorageHealth, deployment: Numbers | None,
            lanes: Sequence[FramePath] = ()) -> str:
    """online, degraded (inference failing, a camera down, state writes failing; on any model's frame path) or
    updating (a deployment)."""
    if path.worker is not None and path.worker.degraded:
        return "degraded"
    if storage.degraded:
        return "degraded"
    if path.cameras is not None and path.cameras.any_lost():
        return "degraded"
    if any(_path_degraded(lane) for lane in lanes):
        return "degraded"
    if deployment and not deployment.get("watching"):
        return "updating"
    return "online"


def _batch_summary(path: FramePath) -> dict[str, Any] | None:
    """The size in use and why (the tuner's, once it has decided), batches run, the per-size stage profile,
    how slots are preprocessed and, with `auto` live, the curve the last decision used."""
    if path.batch_size is None:
        return None
    worker = path.worker
    out: dict[str, Any] = {**path.batch_size.to_dict(), "batches": worker.batches if worker else 0}
    if worker is not None:
        status = worker.batch_status()
        live = status.get("live")
        if live is not None:
            out.update(max_size=live["max_size"], reason=live["reason"])
        out.update(status)
    return out
