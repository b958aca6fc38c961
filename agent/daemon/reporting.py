"""What the running agent says about itself: health, recent fps, the live record `status` reads, the run summary.

A mixin of agent.daemon.runner.Agent, kept apart from the composition so the summary's shape (docs/contract.md, "Run
summary") is in one short module; what it reads of the agent is declared on the class.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from agent.daemon.tracking_host import IDLE, TrackingHost
from agent.pipeline.summary import camera_numbers, capture_totals
from agent.state import LIVE_KEY

if TYPE_CHECKING:
    from agent.daemon.adapt_host import AdaptHost
    from agent.daemon.plane import AgentPlane
    from agent.daemon.result_sinks import ResultSinks
    from agent.daemon.shadow_host import ShadowHost
    from agent.deployments.manager import DeploymentManager
    from agent.live_frame_sampler import LiveFrameSampler
    from agent.pipeline.batch_size import BatchSize
    from agent.pipeline.batcher import Batcher
    from agent.pipeline.cameras import CameraGroup
    from agent.pipeline.frame_stats import FrameStats
    from agent.pipeline.worker import InferenceWorker
    from agent.slots import LoadedModel
    from agent.sources.base import Frame
    from agent.state import StateStore
    from agent.storage_health import StorageHealth
    from agent.video.service import VideoService

log = logging.getLogger(__name__)
RECENT_FPS_WINDOW_S = 5.0


class Reporting:
    """Health, live status and the run summary of the running agent (what they read of it is declared here)."""

    stats: FrameStats
    batcher: Batcher[Frame] | None
    batch_size: BatchSize | None
    cameras: CameraGroup | None
    worker: InferenceWorker | None
    manager: DeploymentManager | None
    plane: AgentPlane | None
    store: StateStore | None
    storage: StorageHealth
    live_frames: LiveFrameSampler | None
    video: VideoService | None
    _delivered: collections.deque[float]
    _recent_results: collections.deque[dict[str, Any]]
    result_sinks: ResultSinks
    active: LoadedModel | None
    adapt_host: AdaptHost | None
    shadow_host: ShadowHost | None
    tracking: TrackingHost = IDLE  # [tracking] (agent.daemon.tracking_host): idle until the start, and while off
    emit: Callable[..., None]

    def persist_live(self) -> None:
        """Write the live numbers where `edge-agent status` (another process) can read them."""
        if self.store is None:
            return
        if self.plane is not None:
            self.plane.health_changed(self.health())
        summary = self.summary()
        with self.storage.guard("live status"):
            self._write_live(summary)

    def _write_live(self, summary: dict[str, Any]) -> None:
        assert self.store is not None
        self.store.set_kv(LIVE_KEY, {
            "ts": time.time(), "state": self.health(), "fps": summary["fps"], "frames": summary["frames"],
            "dropped_frames": summary["dropped_frames"], "latency_ms": summary["latency_ms"],
            "window_latency_ms": self.worker.window.latency.summary() if self.worker else {},
            "errors": summary["errors"], "model": summary["model"], "cameras": summary["cameras"],
            "batch": summary.get("batch"), "deployment": self.manager.status() if self.manager else None,
            "adapt": summary.get("adapt"), "storage": self.storage.status(), "video": summary.get("video"),
            "shadow": summary.get("shadow"), "tracking": summary.get("tracking"),
        })

    def recent_fps(self, window_s: float = RECENT_FPS_WINDOW_S) -> float:
        """Results delivered per second over the last `window_s` (what `status` reports: a whole-run average
        hides a stall, e.g. 4.5 fps shown while a restart flood let 0.2 through)."""
        now = time.monotonic()
        started = self.stats.started
        span = min(window_s, max(now - started, 1e-6))
        times = list(self._delivered)  # a copy: the results thread appends (in time order) meanwhile
        return round((len(times) - bisect.bisect_left(times, now - span)) / span, 2)

    def health(self) -> str:
        """online, degraded (inference failing, a camera down, state writes failing) or updating (a deployment)."""
        if self.worker is not None and self.worker.degraded:
            return "degraded"
        if self.storage.degraded:
            return "degraded"
        if self.cameras is not None and self.cameras.any_lost():
            return "degraded"
        deployment = self.manager.status() if self.manager is not None else None
        if deployment and not deployment.get("watching"):
            return "updating"
        return "online"

    def summary(self) -> dict[str, Any]:
        """The run summary of docs/contract.md, with `cameras` per camera and the batch size in use."""
        shadow = self.shadow_host.session if self.shadow_host is not None else None  # read once: it may end now
        adapt = self.adapt_host.controller if self.adapt_host is not None else None
        return {
            "frames": self.stats.frames,
            "fps": round(self.stats.fps(), 2),
            "dropped_frames": self.batcher.dropped if self.batcher is not None else 0,
            "latency_ms": self.stats.latency.summary(),
            "stages_ms": self.stats.stage_means(),
            "model": self.active.describe() if self.active is not None else {},
            "errors": self.stats.errors,
            "result_sink_errors": self.result_sinks.errors(),
            "camera": capture_totals(self.cameras),
            "cameras": camera_numbers(self.worker, self.batcher, self.cameras),
            "batch": self._batch_summary(),
            "adapt": adapt.status() if adapt is not None else None,
            "live_frames": self.live_frames.stats() if self.live_frames is not None else None,
            "video": self.video.status() if self.video is not None else None,
            "shadow": shadow.report() if shadow is not None else None,  # a shadow deployment running
            "tracking": self.tracking.status(),  # None while off; per camera counts, zones (docs/tracking.md)
            "last_results": list(self._recent_results),
            "duration_s": round(time.monotonic() - self.stats.started, 2),
        }

    def _batch_summary(self) -> dict[str, Any] | None:
        """The size in use and why (the tuner's, once it has decided), batches run, the per-size stage profile,
        how slots are preprocessed and, with `auto` live, the curve the last decision used."""
        if self.batch_size is None:
            return None
        out: dict[str, Any] = {**self.batch_size.to_dict(), "batches": self.worker.batches if self.worker else 0}
        if self.worker is not None:
            status = self.worker.batch_status()
            live = status.get("live")
            if live is not None:
                out.update(max_size=live["max_size"], reason=live["reason"])
            out.update(status)
        return out
