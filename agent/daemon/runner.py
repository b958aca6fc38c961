"""The daemon's composition root: state store, model, frame path (agent.pipeline: cameras -> batcher ->
inference worker), deployments, MQTT plane and control socket — started in order, stopped in reverse."""

from __future__ import annotations

import bisect
import collections
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from agent.adapt import wiring as adapt_wiring
from agent.commands import CommandDispatcher, RateLimit
from agent.control import AgentController
from agent.control_socket import ControlSocketServer
from agent.config import AgentConfig
from agent.deployments.floors import FpsFloor, capacity_fps, fps_floors, refuse_unmeetable
from agent.deployments.manager import DeploymentManager
from agent.deployments.output_health import OutputHealth
from agent.deployments.store import Deployment, DeploymentStore
from agent.deployments import watch as deployment_watch
from agent.pipeline.batch_size import (BatchSize, batch_curve, batch_relative, batch_spread, demand_fps,
                                      resolve_batch_size, stated_fps)
from agent.pipeline.batch_tuner import LiveBatchTuner, make_tuner
from agent.pipeline.batcher import Batcher
from agent.pipeline.cameras import CameraGroup
from agent.pipeline.frame_stats import FrameStats
from agent.pipeline.summary import camera_numbers, capture_totals
from agent.plane import AgentPlane
from agent.sdnotify import Notifier, ProgressWatchdog
from agent.shadow import wiring as shadow_wiring
from agent.live_frame_sampler import LiveFrameSampler
from agent.model_loading import LoadedModel, ModelLoader, live_frames_dir
from agent.sources.base import Frame
from agent.state import StateStore, state_db_path
from agent.storage_health import StorageHealth
from agent.status import BACKEND_KEY, LIVE_KEY, validation_brief
from agent.pipeline.worker import InferenceWorker, limit_opencv_threads
from agent.video.service import VideoService
from engines.errors import EdgeError
from engines.model import ModelSource
from engines.runtime import choose_backend

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 2.0
SHADOW_STOP_S = 15.0  # a candidate still loading when the agent stops finishes its load first
RECENT_FPS_WINDOW_S = 5.0
RECENT_RESULTS = 5  # the run summary's `last_results`
RESULT_META = ("file", "file_frame")  # what a frame's source said about it that its result carries
EventSink = Callable[..., None]


class Agent:
    """Owns the threads of one run; `start`, then `wait`, then `stop`."""

    def __init__(self, config: AgentConfig, on_event: EventSink | None = None) -> None:
        self.config = config
        self.stop_event = threading.Event()
        self.stats = FrameStats()
        self.batcher: Batcher | None = None
        self.batch_size: BatchSize | None = None
        self.store: StateStore | None = None
        self.deployments: DeploymentStore | None = None
        self.manager: DeploymentManager | None = None
        self.loader: ModelLoader | None = None
        self.active: LoadedModel | None = None
        self.previous: LoadedModel | None = None
        self.shadow: Any = None  # agent.shadow.session.ShadowSession of a shadow deployment while it runs
        self.adapt: Any = None  # agent.adapt controller of the active model family (docs/adaptive.md)
        self.output_health = OutputHealth()  # per camera: what the serving model finds (the watch's collapse check)
        # state-store writes that failed (a lock, a full disk): never fatal; a full disk sheds what it can
        self.storage = StorageHealth(self.emit, on_full=self.reclaim_space)
        self.live_frames: LiveFrameSampler | None = None  # [gates] live_frames: recent camera frames for the gates
        self.video: VideoService | None = None  # [video]: MJPEG, stream, snapshots (agent.video)
        self._startup_reclaimed: dict[str, Any] | None = None  # what a nearly full disk cost at start
        self._restart_lock = threading.Lock()
        self._delivered: collections.deque[float] = collections.deque(maxlen=8192)  # when results were delivered
        self._last_restart: dict[str | None, float] = {}  # camera (None: all) -> when its last restart ended
        self.worker: InferenceWorker | None = None
        self.cameras: CameraGroup | None = None
        self.dispatcher: CommandDispatcher | None = None
        self.plane: AgentPlane | None = None
        self.control_server: ControlSocketServer | None = None
        self.notifier = Notifier()
        self.watchdog: ProgressWatchdog | None = None
        self.run_id: int | None = None
        self.event_sinks: list[EventSink] = [on_event] if on_event else []
        self.last_result: dict[str, Any] | None = None
        self._recent_results: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_RESULTS)
        self.state = "starting"
        self._swap_lock = threading.Lock()
        self._last_swap: dict[str, Any] = {}

    # --- events -------------------------------------------------------------------------------

    def emit(self, type_: str, **fields: Any) -> None:
        """Record an event in the state store and hand it to every sink (MQTT plane, socket followers)."""
        if self.store is not None:
            try:
                self.store.add_event(type_, fields)
            except Exception:
                log.exception("could not store event %s", type_)
        if type_ in ("deployment", "rollback", "rolled_back", "camera_lost", "camera_recovered"):
            self.notifier.status(_status_text(type_, fields))
        for sink in list(self.event_sinks):
            try:
                sink(type_, **fields)
            except Exception:
                log.exception("event sink failed for %s", type_)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Open state, recover deployments, load the model, start worker, camera and deployer."""
        cfg = self.config
        limit_opencv_threads(cfg.pipeline.opencv_threads)
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        sample_dir = live_frames_dir(cfg)
        if sample_dir is not None:
            self.live_frames = LiveFrameSampler(sample_dir, cfg.gates.live_frames, int(cfg.gates.live_frames_max_mb * 2**20),
                                                cfg.gates.live_frames_interval_s)
            self.live_frames.start()
        self.store = self._open_store()
        self.run_id = self.store.start_run(os.getpid())
        self.store.set_kv(LIVE_KEY, {"ts": time.time(), "state": "starting"})
        self.deployments = DeploymentStore(self.store)
        self.loader = ModelLoader(cfg, self.stop_event)
        self.manager = DeploymentManager(self.deployments, self, cfg.state_dir / "artifacts" / "deployed",
                                         self.loader.artifacts, cfg.deployments, self.emit, self.stop_event)
        self.dispatcher = CommandDispatcher(AgentController(self, on_set_config=self._set_live_config),
                                            state_db_path(cfg.state_dir), max_payload_bytes=cfg.mqtt.max_payload_bytes,
                                            deploy_rate=RateLimit(cfg.deployments.max_requests_per_minute, 60.0))
        self.plane = AgentPlane(self)  # before the model loads, so start-up events reach the outbox
        self.event_sinks.append(self.plane.on_event)
        self.plane.start()
        if self.store.recovered:  # into the outbox now, on the broker at the next connect
            self.emit("state_db_quarantined", **self.store.recovered)
        if self._startup_reclaimed:
            self.emit("storage_reclaimed", at="start", **self._startup_reclaimed)
        self.manager.recover()
        self.active = self._load_initial()
        self.video = self._video_service()
        self._start_frame_path()
        self.video.start()
        adapt_wiring.restart(self)  # a family: its other variants build in the background
        self.manager.start()
        self.control_server = ControlSocketServer(cfg.control_socket_path(), self.dispatcher.dispatch, cfg.control.group)
        self.control_server.start()
        self.state = "running"
        self.watchdog = ProgressWatchdog(self.notifier, lambda: self.worker.heartbeat if self.worker else 0)
        self.watchdog.start()
        self.notifier.ready(f"serving {self.active.source.label}")
        self.persist_live()

    def _open_store(self) -> StateStore:
        """The state store (a corrupt file is moved aside). On a nearly full disk, what needs no database is
        shed first (agent.storage_reclaim.reclaim_before_start); when the store still cannot open, the error
        says the disk is full and how much is free, not just "disk I/O error"."""
        from agent.storage_reclaim import MIN_FREE_BYTES, free_bytes, reclaim_before_start

        cfg, path = self.config, state_db_path(self.config.state_dir)
        shed = reclaim_before_start(cfg.state_dir, live_frames_dir(cfg), path)
        if shed is not None:
            log.warning("starting on a nearly full disk: freed %.1f MB (%s)", shed.total_bytes / 2**20, shed.bytes)
        try:
            store = StateStore.open_checked(path)
        except EdgeError as exc:
            free = free_bytes(cfg.state_dir)
            if free >= MIN_FREE_BYTES:
                raise
            raise EdgeError(f"cannot open the state database: the disk holding {cfg.state_dir} is full ({free} bytes "
                            f"free{', after freeing ' + str(shed.total_bytes) + ' bytes' if shed else ''}); free space "
                            "there, or set state_dir on another disk", code="STORAGE_FULL") from exc
        if shed is not None and shed.total_bytes:
            self._startup_reclaimed = shed.to_dict()
        return store

    def _start_frame_path(self) -> None:
        """Cameras -> batcher -> worker, sized by `[batch]` and what the loaded engine measured."""
        cfg, active = self.config, self.active
        assert active is not None
        cameras = cfg.camera_list()
        self.batch_size = self._batch_size_for(active)
        log.info("%d camera(s), batch size %d (%s)", len(cameras), self.batch_size.size, self.batch_size.reason)
        self.batcher = Batcher([c.name for c in cameras], self.batch_size.size, cfg.batch.timeout_ms / 1e3)
        self.cameras = CameraGroup(cameras, self.batcher, self.emit, on_restart=self._camera_restarted)
        self.batcher.is_live = self.cameras.is_live
        self.stats = FrameStats()  # fps and duration count from the first frame the model can take
        self.worker = InferenceWorker(active.runtime, self.batcher, self.stop_event, self.stats,
                                      self._on_result, cfg.pipeline.max_consecutive_errors,
                                      overlap_postprocess=cfg.pipeline.overlap_postprocess,
                                      tuner=self._tuner_for(active, self.batch_size),
                                      parallel_preprocess=cfg.batch.parallel_preprocess)
        self.worker.start()
        self.cameras.start()

    def _camera_restarted(self, camera: str) -> None:
        """A camera (re)opened: its frames follow no earlier ones, so a stateful model starts its state again."""
        if self.worker is not None:
            self.worker.runtime.reset_state(camera)

    def _video_service(self) -> VideoService:
        """`[video]`: the tap always (snapshots need it; it costs nothing unwatched), server and stream when set."""
        cfg, plane = self.config, self.plane
        mqtt = plane.mqtt if plane is not None else None
        return VideoService(cfg.video, cfg.device_id, [c.name for c in cfg.camera_list()],
                            mqtt.publish_snapshot if mqtt is not None else None, self.emit,
                            mqtt.topics.snapshot if mqtt is not None else None)

    def _batch_size_for(self, loaded: LoadedModel) -> BatchSize:
        """`[batch] max_size` against `loaded`'s own measured curve: "auto" follows the engine in use."""
        return self._batch_size_of(loaded.source, loaded.provisioned)

    def _batch_size_of(self, source: ModelSource, provisioned: Any) -> BatchSize:
        cfg = self.config
        cameras = cfg.camera_list()
        return resolve_batch_size(cfg.batch.max_size, len(cameras), batch_curve(provisioned),
                                  source.manifest.gates.latency_budget_ms, demand_fps(cameras),
                                  spread=batch_spread(provisioned), relative=batch_relative(provisioned),
                                  stateful=source.manifest.state is not None)

    def _tuner_for(self, loaded: LoadedModel, initial: BatchSize) -> LiveBatchTuner | None:
        """`loaded`'s live batch-size tuner (agent.pipeline.batch_tuner), None where its size is fixed."""
        cfg, cameras = self.config, self.config.camera_list()
        return make_tuner(cfg.batch, len(cameras), batch_curve(loaded.provisioned), batch_spread(loaded.provisioned),
                          loaded.source.manifest.gates.latency_budget_ms, demand_fps(cameras), initial,
                          relative=batch_relative(loaded.provisioned))

    def fps_floors(self, source: ModelSource, provisioned: Any) -> dict[str, FpsFloor]:
        """Each camera's fps floor under `source`: from its own gate-measured capacity at the batch size it
        will run at and the cameras' stated rates, or an absolute floor (agent.deployments.floors)."""
        size = self._batch_size_of(source, provisioned).size
        capacity = capacity_fps(provisioned.validation, batch_curve(provisioned), size)
        rates = {camera.name: stated_fps(camera) for camera in self.config.camera_list()}
        return fps_floors(self.config.deployments, source.manifest.gates.min_fps, capacity, rates)

    def swap_model(self, loaded: LoadedModel) -> None:
        """Swap `loaded` in between two batches, with the batch size re-resolved from its curve (deployments,
        rollbacks and adapt switches all come here; a 640x480 and a 320x224 variant can pick different sizes)."""
        assert self.worker is not None
        size = self._batch_size_for(loaded)
        self.worker.swap(loaded.runtime, batch_size=size.size, tuner=self._tuner_for(loaded, size))
        if self.batch_size is None or size.size != self.batch_size.size:
            log.info("batch size %d -> %d for %s (%s)", self.batch_size.size if self.batch_size else 0, size.size,
                     loaded.source.label, size.reason)
        self.batch_size = size

    def restart_capture(self, camera: str | None = None) -> dict[str, Any]:
        """Reopen every camera, or only `camera`, with fresh threads (the `restart_pipeline` command); the model
        and the inference loop keep running, and a camera not named loses no frame."""
        names = [c.name for c in self.config.camera_list()]
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

    def _load_initial(self) -> LoadedModel:
        assert self.loader is not None and self.store is not None
        source, origin = self.loader.initial_source(self.store.model_slot("active"), self.emit)
        choice = choose_backend("auto").to_dict() if self.config.model.backend == "auto" else None
        self.store.set_kv(BACKEND_KEY, choice)  # which backend `auto` runs and why not TensorRT, for `status`
        if choice:
            self.emit("backend_selected", **choice)
        loaded = self.loader.load(source, origin, on_progress=self._engine_progress)
        self._record_active(loaded)
        self.emit("model_loaded", model=loaded.describe(), origin=origin)
        log.info("model %s loaded on %s (%s, cache %s)", source.label, loaded.describe()["backend"],
                 loaded.describe()["precision"], "hit" if loaded.provisioned.hit else "miss")
        return loaded

    def _engine_progress(self, event: dict[str, Any]) -> None:
        """Engine cache/build/validation progress of the start-up model, as `engine` events."""
        fields = {k: v for k, v in event.items() if k != "type"}
        self.notifier.extend_timeout(120)  # a TensorRT build on a cache miss outlasts TimeoutStartSec
        self.emit("engine", event=event.get("type", "progress"), **fields)

    def _record_active(self, loaded: LoadedModel, deployment_id: str | None = None) -> None:
        assert self.store is not None
        m = loaded.source.manifest
        info = {**loaded.describe(), "origin": loaded.origin, "deployment_id": deployment_id,
                "validation": validation_brief(loaded.provisioned.validation)}
        self.store.set_active_model(m.name, m.version, str(loaded.source.root), loaded.source.sha256, info)

    def _on_result(self, frame: Frame, result: Any, runtime: Any) -> None:
        self._delivered.append(time.monotonic())
        adapt_wiring.on_result(self, frame, runtime)
        self.output_health.record(frame.source, result, runtime)
        if self.live_frames is not None:
            self.live_frames.offer(frame.source, frame.image)
        if self.video is not None:
            self.video.offer(frame.source, frame.index, frame.image, result, frame.captured_at, runtime)
        named = {k: frame.meta[k] for k in RESULT_META if k in frame.meta}  # a file source: which file it was
        head = {"camera": frame.source, "frame": frame.index, **named}
        self.last_result = {**head, **result.to_dict(max_items=20, masks=False)}  # every frame: nothing costly
        self._recent_results.append(self.last_result)
        if self.plane is not None:  # masks' run lengths only for the results the rate limit lets out
            self.plane.on_result(self.last_result, lambda: {**head, **result.to_dict(max_items=20)})
        shadow = self.shadow
        if shadow is not None:  # last: a share of the frames, into a one-slot mailbox; never waits
            try:
                shadow.offer(frame.source, frame.image, frame.captured_at, result, runtime)
            except Exception:  # the shadow's fault is never the serving model's
                log.exception("shadow: offering a frame failed")

    def _set_live_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        return self.plane.set_config(changes) if self.plane is not None else {}

    def wait(self, duration: float | None, tick: Callable[["Agent"], None] | None = None, tick_s: float = 1.0) -> None:
        """Block until stopped (signal) or `duration` elapsed, calling `tick` periodically."""
        deadline = None if duration is None else time.monotonic() + duration
        while not self.stop_event.is_set():
            timeout = tick_s if deadline is None else min(tick_s, max(0.0, deadline - time.monotonic()))
            if self.stop_event.wait(timeout):
                break
            if tick is not None:
                tick(self)
            if deadline is not None and time.monotonic() >= deadline:
                break

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
            "shadow": summary.get("shadow"),
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

    def stop(self) -> dict[str, Any]:
        """Stop threads in reverse start order, close models and the store; returns the summary."""
        self.notifier.stopping("stopping")
        if self.watchdog is not None:
            self.watchdog.stop()
        self.stop_event.set()
        adapt_wiring.halt(self)
        if self.batcher is not None:
            self.batcher.close()
        if self.control_server is not None:
            self.control_server.stop()
            self.control_server = None
        if self.video is not None:
            self.video.stop()
        if self.cameras is not None:
            self.cameras.stop(JOIN_TIMEOUT_S)
        if self.live_frames is not None:
            self.live_frames.close()
        for thread in (self.manager, self.worker):
            if thread is not None and thread.is_alive():
                # a shadow ends on the deployment thread, which closes the candidate and records why: wait for it
                thread.join(SHADOW_STOP_S if thread is self.manager and self.shadow is not None else JOIN_TIMEOUT_S)
                if thread.is_alive():
                    log.error("thread %s did not stop within %.1f s", thread.name, JOIN_TIMEOUT_S)
        summary = self.summary()
        adapt_wiring.stop(self)
        if self.plane is not None:
            self.plane.stop()
            self.plane = None
        for loaded in {id(m): m for m in (self.active, self.previous) if m is not None}.values():
            loaded.runtime.close()
        if self.dispatcher is not None:
            self.dispatcher.close()
        if self.store is not None:
            with self.storage.guard("run summary"):
                if self.run_id is not None:
                    self.store.finish_run(self.run_id, summary)
                self.store.set_kv(LIVE_KEY, {"ts": time.time(), "state": "stopped"})
            self.store.close()
            self.store = None
        self.state = "stopped"
        return summary

    def summary(self) -> dict[str, Any]:
        """The run summary of CONTRACT.md, with `cameras` per camera and the batch size in use."""
        shadow = self.shadow  # read once: the deployment thread detaches it when the shadow ends
        return {
            "frames": self.stats.frames,
            "fps": round(self.stats.fps(), 2),
            "dropped_frames": self.batcher.dropped if self.batcher is not None else 0,
            "latency_ms": self.stats.latency.summary(),
            "stages_ms": self.stats.stage_means(),
            "model": self.active.describe() if self.active is not None else {},
            "errors": self.stats.errors,
            "camera": capture_totals(self.cameras),
            "cameras": camera_numbers(self.worker, self.batcher, self.cameras),
            "batch": self._batch_summary(),
            "adapt": self.adapt.status() if self.adapt is not None else None,
            "live_frames": self.live_frames.stats() if self.live_frames is not None else None,
            "video": self.video.status() if self.video is not None else None,
            "shadow": shadow.report() if shadow is not None else None,  # a shadow deployment running
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

    # --- SwapHost (called from the deployment worker) ------------------------------------------

    def provision(self, source: ModelSource, on_progress: Callable[[dict], None], stop: threading.Event) -> Any:
        """Engine for `source`: cached or built in a child process, then validated."""
        assert self.loader is not None
        provisioned = self.loader.provision(source, on_progress, stop)
        refuse_unmeetable(self.fps_floors(source, provisioned))  # GATE_FPS now, not WATCH_FPS after the swap
        return provisioned

    def activate(self, source: ModelSource, provisioned: Any, dep: Deployment) -> dict[str, Any]:
        """Swap the candidate in between two frames, by the configured strategy; returns what happened."""
        assert self.loader is not None and self.worker is not None
        strategy = self.config.deployments.swap_strategy
        adapt_wiring.stop(self)  # a deployment replaces the whole family: no variant switch during the swap
        with self._swap_lock:
            fps_before = self.worker.window.fps()
            fps_cameras = {name: round(w.fps(), 2) for name, w in self.worker.camera_windows.items()}
            before = self.worker.last_result_at
            if strategy == "overlap":
                candidate = self.loader.load_provisioned(source, provisioned, "deployment")
                self.swap_model(candidate)
            else:
                candidate = self._stop_start(source, provisioned)
            gap_ms = self._measure_gap(before)
            self._retire(self.active)
            self.active = candidate
        adapt_wiring.restart(self, hold=True)  # no variant build or switch until the watch passed (watch)
        self._last_swap = {"strategy": strategy, "gap_ms": gap_ms, "fps_before": round(fps_before, 2),
                           "fps_before_cameras": fps_cameras, "previous_loaded": self.previous is not None}
        return dict(self._last_swap)

    def _stop_start(self, source: ModelSource, provisioned: Any) -> LoadedModel:
        """Free the active engine first (devices that cannot hold two), then load the candidate."""
        assert self.loader is not None and self.worker is not None and self.active is not None
        self.worker.pause()
        try:
            self.active.runtime.close()
            try:
                candidate = self.loader.load_provisioned(source, provisioned, "deployment")
            except Exception:
                restored = self.loader.reload(self.active)  # the old engine must come back
                self.swap_model(restored)
                self.active = restored
                raise
            self.swap_model(candidate)
        finally:
            self.worker.resume()
        self.active.closed = True
        return candidate

    def _measure_gap(self, before: float | None, timeout: float = 30.0) -> float | None:
        """Time from the last result of the old model to the first result of the new one."""
        assert self.worker is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop_event.is_set():
            first_new = self.worker.window.opened_at  # the new model's first result
            if first_new is not None:
                return None if before is None else round((first_new - before) * 1e3, 1)
            time.sleep(0.005)
        return None

    def _retire(self, old: LoadedModel | None) -> None:
        """Keep the replaced model loaded for instant rollback while memory allows."""
        if self.previous is not None and self.previous is not old:
            self.previous.runtime.close()
            self.previous = None
        if old is None or getattr(old, "closed", False):
            self.previous = None
            return
        free_mb = psutil.virtual_memory().available / 2**20
        cfg = self.config.deployments
        if cfg.keep_previous_loaded and cfg.swap_strategy == "overlap" and free_mb >= cfg.min_free_memory_mb:
            self.previous = old
        else:
            old.runtime.close()
            self.previous = None

    def reclaim_space(self) -> dict[str, Any]:
        """A full disk: shed failed downloads, unused artifacts, the live-frame sample, other models' engines
        and the oldest half of the outbox's telemetry (agent.storage_reclaim); a `storage_reclaimed` event."""
        from agent.storage_reclaim import reclaim

        cfg = self.config
        slots = self.store.serving_models() if self.store is not None else None
        keep = {Path(row["path"]) for row in slots} if slots is not None else None
        pinned = {row["sha256"] for row in slots or []}

        def engines(out: Any) -> None:
            report = self.collect_engines(pinned, budget_bytes=0)
            out.add("engines", len(report.removed), report.freed_bytes)

        def outbox(out: Any) -> None:
            if self.plane is not None:
                out.add("outbox_telemetry", *self.plane.mqtt.outbox.shed_telemetry(0.5))

        steps = [("engines", engines)] if pinned else []  # unknown active model: no engine is safe to drop
        result = reclaim(cfg.state_dir / "artifacts" / "deployed", keep, live_frames_dir(cfg),
                         [*steps, ("outbox_telemetry", outbox)])
        log.warning("disk full: freed %.1f MB (%s)", result.total_bytes / 2**20, result.bytes)
        self.emit("storage_reclaimed", **result.to_dict())
        return result.to_dict()

    def collect_engines(self, pinned: set[str], budget_bytes: int | None = None) -> Any:
        """Engine cache GC, never the `pinned` models' engines: after a deployment to `[engines]
        cache_budget_mb`, on a full disk to 0. Returns the cache's GcReport."""
        from engines.cache import EngineCache

        budget = self.config.engines.cache_budget_mb * 2**20 if budget_bytes is None else budget_bytes
        cache = EngineCache(self.config.cache_dir, state_db_path(self.config.state_dir), on_event=self._engine_progress)
        try:
            report = cache.gc(budget, pinned)
        finally:
            cache.close()
        if report.removed:
            log.info("engine cache: collected %d engine(s), %.1f MB", len(report.removed), report.freed_bytes / 2**20)
        return report

    def commit_active(self, source: ModelSource, provisioned: Any, dep: Deployment, store: DeploymentStore) -> None:
        """The new active model and the deployment's `active` state, in one transaction."""
        assert self.store is not None and self.active is not None
        with self.store.transaction(durable=True):
            self._record_active(self.active, dep.id)
            store.apply(dep, "active")

    def watch(self, dep: Deployment, stop: threading.Event) -> dict[str, Any] | None:
        """Judge the new model for the watch window; the first violation (with numbers) or None."""
        assert self.worker is not None and self.cameras is not None
        assert self.active is not None
        budget = self.active.source.manifest.gates.latency_budget_ms
        floors = self.fps_floors(self.active.source, self.active.provisioned)
        violation = deployment_watch.watch_model(
            self.worker, self.cameras, self.config.deployments, budget, stop, floors,
            still_current=lambda: self.active is not None and self.active.deployment_ok(dep),
            health=self.output_health)
        if violation is not None:
            violation["swap_gap_ms"] = self._last_swap.get("gap_ms")
            return violation
        if not stop.is_set() and self.active.deployment_ok(dep):
            self.emit("watch_passed", deployment_id=dep.id, swap_gap_ms=self._last_swap.get("gap_ms"),
                      **deployment_watch.watch_summary(self.worker, floors, self.output_health))
        adapt_wiring.release(self)  # the new family builds its variants and switches only now
        return None

    def start_shadow(self, source: ModelSource, provisioned: Any, dep: Deployment, plan: Any,
                     on_verdict: Callable[[Any], None]) -> Any:
        """A shadow deployment's candidate beside the serving model (agent.shadow.wiring)."""
        return shadow_wiring.start(self, source, provisioned, dep, plan, on_verdict)

    def check_shadow(self, source: ModelSource) -> None:
        """Refuse a shadow that could compare nothing (SHADOW_INCOMPARABLE)."""
        shadow_wiring.check_comparable(self, source)

    def stop_shadow(self, session: Any) -> None:
        """The shadow gets no more frames; its engine is closed."""
        shadow_wiring.stop(self, session)

    def serving_label(self) -> str:
        """name@version of the serving model."""
        return shadow_wiring.serving_label(self)

    def rollback(self, reason: str, numbers: dict[str, Any] | None = None) -> dict[str, Any]:
        """Back to the previous model: instant when it is still loaded, else loaded again from its artifact."""
        assert self.store is not None and self.loader is not None and self.worker is not None
        adapt_wiring.stop(self)  # back to the previous family, at the variant kept loaded for it
        with self._swap_lock:
            row = self.store.model_slot("previous")
            if row is None:
                raise EdgeError("no previous model to roll back to", code="NO_PREVIOUS_MODEL")
            started = time.monotonic()
            target = self.previous if self.previous is not None and self.previous.source.sha256 == row["sha256"] else None
            if target is None:
                target = self.loader.load_path(Path(row["path"]), row["info"].get("origin", "deployment"))
            before = self.worker.last_result_at
            self.swap_model(target)
            replaced, self.active, self.previous = self.active, target, None
            gap_ms = self._measure_gap(before)
            if replaced is not None:
                replaced.runtime.close()
            self._record_active(target, row["info"].get("deployment_id"))
        adapt_wiring.restart(self)
        result = {"model": target.describe(), "reason": reason, "gap_ms": gap_ms,
                  "took_ms": round((time.monotonic() - started) * 1e3, 1), **({"numbers": numbers} if numbers else {})}
        self.emit("rollback", **result)
        log.warning("rolled back to %s (%s)", target.source.label, reason)
        return result


def _status_text(type_: str, fields: dict[str, Any]) -> str:
    """One short STATUS= line for `systemctl status`."""
    if type_ == "deployment":
        return f"deployment {fields.get('deployment_id')}: {fields.get('state')}"
    return f"{type_} {fields.get('camera') or fields.get('reason') or ''}".strip()
