"""The frame path of one run as a part of the daemon: cameras -> batcher -> inference worker, sized by `[batch]` and
the serving engine's measured curve, with the record of what it delivered.

It owns the frame-path objects (made at `start`, None before), so the parts that read or drive them (the
deployment's swaps, the live snapshot, the watch) receive this object, never the agent that composes it.

One frame path serves one model on its cameras: the agent's own (`[model]`) serves the cameras without `model`;
each `[models.NAME]` in use has one more (agent.daemon.model_lanes), made over `AgentConfig.lane_config(NAME)`,
whose results name the model (`model_name`).
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from typing import Any, Callable

from agent.config.tree import AgentConfig
from agent.daemon.result_sinks import ResultSinks
from agent.pipeline.batch_size import BatchSize, build_curve, demand_fps, resolve_batch_size
from agent.pipeline.batch_tuner import LiveBatchTuner, make_tuner
from agent.pipeline.batcher import Batcher
from agent.pipeline.cameras import CameraGroup
from agent.pipeline.frame_stats import FrameStats
from agent.pipeline.worker import InferenceWorker
from agent.serving.slots import LoadedModel
from agent.sources.base import Frame
from engines.runtime.provisioned import ProvisionResult
from kernel.errors import EdgeError
from engines.model.source import ModelSource
from engines.postprocess import InferenceResult
from engines.runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 2.0
RECENT_RESULTS = 5  # the run summary's `last_results`
RECENT_FPS_WINDOW_S = 5.0
RESULT_META = ("file", "file_frame")  # what a frame's source said about it that its result carries


class FramePath:
    """Cameras, batcher and worker of one run (None until `start`), their counters and the results delivered."""

    def __init__(self, config: AgentConfig, stop_event: threading.Event, emit: Callable[..., None],
                 result_sinks: ResultSinks, on_camera_restart: Callable[[str], None],
                 model_name: str | None = None) -> None:
        self.config = config
        self.model_name = model_name  # a [models.NAME] lane's NAME (its results carry it); None: [model]'s
        self.stop_event = stop_event
        self.emit = emit
        self.result_sinks = result_sinks
        self.on_camera_restart = on_camera_restart  # tracking starts the camera's ids again
        self.stats = FrameStats()
        self.batcher: Batcher[Frame] | None = None
        self.batch_size: BatchSize | None = None
        self.worker: InferenceWorker | None = None
        self.cameras: CameraGroup | None = None
        self.last_result: dict[str, Any] | None = None
        self._recent_results: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_RESULTS)
        self._delivered: collections.deque[float] = collections.deque(maxlen=8192)  # when results were delivered
        self._restart_lock = threading.Lock()
        self._last_restart: dict[str | None, float] = {}  # camera (None: all) -> when its last restart ended

    def start(self, active: LoadedModel) -> None:
        """Cameras -> batcher -> worker, sized by `[batch]` and what `active`'s engine measured."""
        cfg = self.config
        cameras = cfg.camera_list()
        self.batch_size = self.batch_size_of(active.source, active.provisioned)
        log.info("%d camera(s), batch size %d (%s)", len(cameras), self.batch_size.size, self.batch_size.reason)
        self.batcher = Batcher([c.name for c in cameras], self.batch_size.size, cfg.batch.timeout_ms / 1e3)
        self.cameras = CameraGroup(cameras, self.batcher, self.emit, on_restart=self._camera_restarted)
        self.batcher.is_live = self.cameras.is_live
        self.stats = FrameStats()  # fps and duration count from the first frame the model can take
        self.worker = InferenceWorker(active.runtime, self.batcher, self.stop_event, self.stats,
                                      self.result_sinks, cfg.pipeline.max_consecutive_errors,
                                      overlap_postprocess=cfg.pipeline.overlap_postprocess,
                                      tuner=self._tuner_for(active, self.batch_size),
                                      parallel_preprocess=cfg.batch.parallel_preprocess)
        self.worker.start()
        self.cameras.start()

    def _camera_restarted(self, camera: str) -> None:
        """A camera (re)opened: its frames follow no earlier ones, so a stateful model starts its state again."""
        if self.worker is not None:
            self.worker.reset_state(camera)
        self.on_camera_restart(camera)

    def batch_size_of(self, source: ModelSource, provisioned: ProvisionResult) -> BatchSize:
        """`[batch] max_size` against `provisioned`'s own measured curve: "auto" follows the engine in use."""
        cfg, cameras, curve = self.config, self.config.camera_list(), build_curve(provisioned)
        return resolve_batch_size(cfg.batch.max_size, len(cameras), curve.curve,
                                  source.manifest.gates.latency_budget_ms, demand_fps(cameras),
                                  spread=curve.spread, relative=curve.relative,
                                  stateful=source.manifest.state is not None)

    def _tuner_for(self, loaded: LoadedModel, initial: BatchSize) -> LiveBatchTuner | None:
        """`loaded`'s live batch-size tuner (agent.pipeline.batch_tuner), None where its size is fixed."""
        cfg, cameras, curve = self.config, self.config.camera_list(), build_curve(loaded.provisioned)
        return make_tuner(cfg.batch, len(cameras), curve.curve, curve.spread,
                          loaded.source.manifest.gates.latency_budget_ms, demand_fps(cameras), initial,
                          relative=curve.relative)

    def swap(self, loaded: LoadedModel) -> None:
        """Swap `loaded` in between two batches, with the batch size re-resolved from its curve (a 640x480 and a
        320x224 variant can pick different sizes)."""
        assert self.worker is not None
        size = self.batch_size_of(loaded.source, loaded.provisioned)
        self.worker.swap(loaded.runtime, batch_size=size.size, tuner=self._tuner_for(loaded, size))
        if self.batch_size is None or size.size != self.batch_size.size:
            log.info("batch size %d -> %d for %s (%s)", self.batch_size.size if self.batch_size else 0, size.size,
                     loaded.source.label, size.reason)
        self.batch_size = size

    def camera_names(self) -> list[str]:
        """The cameras this frame path serves, in config order."""
        return [c.name for c in self.config.camera_list()]

    def restart_capture(self, camera: str | None = None) -> dict[str, Any]:
        """Reopen every camera, or only `camera`, with fresh threads (the `restart_pipeline` command); the model
        and the inference loop keep running, and a camera not named loses no frame."""
        names = self.camera_names()
        if camera is not None and camera not in names:
            raise EdgeError(f"args.camera: no camera named {camera!r}; this agent has {', '.join(names)}",
                            code="INVALID_COMMAND")
        if self.cameras is None or self.stop_event.is_set():
            return {"restarted": False}
        requested = time.monotonic()
        with self._restart_lock:  # a flood of restarts waits here, and is answered by the restart that ran
            done = self._last_restart.get(camera) or self._last_restart.get(None)
            if done is not None and done >= requested:
                return {"restarted": True, "cameras": self.cameras.names if camera is None else [camera],
                        "coalesced": True}
            if camera is None:
                self.cameras.restart(JOIN_TIMEOUT_S)
            else:
                self.cameras.restart_camera(camera, JOIN_TIMEOUT_S)
            self._last_restart[camera] = time.monotonic()
        restarted = self.cameras.names if camera is None else [camera]
        self.emit("pipeline_restarted", cameras=restarted)
        return {"restarted": True, "cameras": restarted}

    def record_result(self, frame: Frame, result: InferenceResult, runtime: ModelRuntime) -> None:
        """The first result sink: when it was delivered, and the last few results (cheap: no masks)."""
        self._delivered.append(time.monotonic())
        self.last_result = {**self.head(frame), **result.to_dict(max_items=20, masks=False)}
        self._recent_results.append(self.last_result)

    def head(self, frame: Frame) -> dict[str, Any]:
        """What names a result of this frame path: `result_head`, and a `[models.NAME]` lane's `model`."""
        head = result_head(frame)
        if self.model_name is not None:
            head["model"] = self.model_name
        return head

    def recent_results(self) -> list[dict[str, Any]]:
        """The run summary's `last_results`, oldest first."""
        return list(self._recent_results)

    def recent_fps(self, window_s: float = RECENT_FPS_WINDOW_S) -> float:
        """Results delivered per second over the last `window_s` (what `status` reports: a whole-run average
        hides a stall, e.g. 4.5 fps shown while a restart flood let 0.2 through)."""
        now = time.monotonic()
        span = min(window_s, max(now - self.stats.started, 1e-6))
        times = list(self._delivered)  # a copy: the results thread appends (in time order) meanwhile
        return round((len(times) - bisect.bisect_left(times, now - span)) / span, 2)


def result_head(frame: Frame) -> dict[str, Any]:
    """What names a result: its camera and frame, and for a file source which file it was."""
    return {"camera": frame.source, "frame": frame.index, **{k: frame.meta[k] for k in RESULT_META if k in frame.meta}}
