"""The daemon's composition root: state store, model, frame path (agent.pipeline: cameras -> batcher ->
inference worker), deployments, MQTT plane and control socket — started in order, stopped in reverse."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Callable

import psutil

from agent.adapt.controller import AdaptController
from agent.control.commands import CommandDispatcher
from agent.config import AgentConfig
from agent.control.control_socket import ControlSocketServer
from agent.daemon.adapt_host import AdaptHost
from agent.daemon.control import AgentController
from agent.daemon.model_loading import ModelLoader, live_frames_dir
from agent.daemon.plane import AgentPlane
from agent.daemon.reporting import Reporting
from agent.daemon.result_sinks import ResultSinks
from agent.daemon.shadow_host import ShadowHost
from agent.daemon.swaps import Swaps
from agent.deployments.manager import DeploymentManager
from agent.deployments.store import DeploymentStore
from agent.live_frame_sampler import LiveFrameSampler
from agent.pipeline.batch_size import (
    BatchSize,
    batch_curve,
    batch_relative,
    batch_spread,
    demand_fps,
    resolve_batch_size,
)
from agent.pipeline.batch_tuner import LiveBatchTuner, make_tuner
from agent.pipeline.batcher import Batcher
from agent.pipeline.cameras import CameraGroup
from agent.pipeline.frame_stats import FrameStats
from agent.pipeline.output_health import OutputHealth
from agent.pipeline.worker import InferenceWorker, limit_opencv_threads
from agent.control.rate_limit import RateLimit
from agent.sdnotify import Notifier, ProgressWatchdog
from agent.shadow.session import ShadowSession
from agent.slots import LoadedModel, ModelSlots
from agent.sources.base import Frame
from agent.state import BACKEND_KEY, LIVE_KEY, QUICK_BUSY_TIMEOUT_S, StateStore, state_db_path, validation_brief
from agent.storage_health import StartWaits, StorageHealth
from agent.storage_reclaim import collect_engines, free_bytes, open_state_store, reclaim_running
from agent.video.service import VideoService
from engines.errors import EdgeError
from engines.model import ModelSource
from engines.runtime import choose_backend

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 2.0
SHADOW_STOP_S = 15.0  # a candidate still loading when the agent stops finishes its load first
RECENT_RESULTS = 5  # the run summary's `last_results`
RESULT_META = ("file", "file_frame")  # what a frame's source said about it that its result carries
EventSink = Callable[..., None]


class Agent(Swaps, Reporting):
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
        self.slots = ModelSlots(self.swap_model, self._keep_previous)  # active, previous, their lock
        self.shadow_host: ShadowHost | None = None  # a shadow deployment's candidate while it runs (agent.shadow)
        self.adapt_host: AdaptHost | None = None  # the active family's controller (docs/adaptive.md)
        self.output_health = OutputHealth()  # per camera: what the serving model finds (the watch's collapse check)
        # state-store writes that fail (a lock, a full disk) are never fatal: they wait; a full disk is shed from
        self.storage = StorageHealth(self.emit, self.reclaim_space, lambda: free_bytes(config.state_dir),
                                     str(config.state_dir))
        self.live_frames: LiveFrameSampler | None = None  # [gates] live_frames: recent camera frames for the gates
        self.video: VideoService | None = None  # [video]: MJPEG, stream, snapshots (agent.video)
        self._startup_reclaimed: dict[str, Any] | None = None  # what a nearly full disk cost at start
        self._late_deployments: threading.Thread | None = None  # makes the deployment manager the store refused
        self._restart_lock = threading.Lock()
        self._delivered: collections.deque[float] = collections.deque(maxlen=8192)  # when results were delivered
        self._last_restart: dict[str | None, float] = {}  # camera (None: all) -> when its last restart ended
        self.worker: InferenceWorker | None = None
        self.cameras: CameraGroup | None = None
        self.dispatcher: CommandDispatcher | None = None
        self.plane: AgentPlane | None = None
        self.control_server: ControlSocketServer | None = None
        self.notifier = Notifier()
        self.waits = StartWaits(self.storage, self.stop_event, self.notifier)  # a store it cannot use yet
        self.watchdog: ProgressWatchdog | None = None
        self.run_id: int | None = None
        self.event_sinks: list[EventSink] = [on_event] if on_event else []
        self.result_sinks = ResultSinks()  # each result: the record, adaptation, health, video, MQTT, shadow
        self.last_result: dict[str, Any] | None = None
        self._recent_results: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_RESULTS)
        self.state = "starting"
        self._last_swap: dict[str, Any] = {}

    # --- the model slots (agent.slots): deployments and adaptation change them, nothing else ------

    @property
    def active(self) -> LoadedModel | None:
        """The serving model."""
        return self.slots.active

    @active.setter
    def active(self, loaded: LoadedModel | None) -> None:
        self.slots.active = loaded

    @property
    def previous(self) -> LoadedModel | None:
        """The model kept loaded for an instant rollback (None: a rollback loads it again)."""
        return self.slots.previous

    @property
    def adapt(self) -> AdaptController | None:
        """The active family's controller; None for a single model (or before start)."""
        return self.adapt_host.controller if self.adapt_host is not None else None

    def _adapt_do(self, action: Callable[[AdaptHost], Any]) -> None:
        if self.adapt_host is not None:
            action(self.adapt_host)

    def _sample_telemetry(self) -> dict[str, Any]:
        """One telemetry reading from the plane's collector (the agent's one jtop/NVML client); {} without one."""
        collector = getattr(self.plane.telemetry if self.plane is not None else None, "collector", None)
        return collector.sample() if collector is not None else {}

    @property
    def shadow(self) -> ShadowSession | None:
        """The running shadow session, if any (the deployment thread detaches it when the shadow ends)."""
        return self.shadow_host.session if self.shadow_host is not None else None

    def _throttled(self) -> bool:
        """The device throttles now (the telemetry's throttle counters moved): a shadow yields."""
        return bool(getattr(self.plane.telemetry if self.plane is not None else None, "throttled", False))

    def _adapt_over_limit(self) -> bool:
        """The adaptive policy sees a limit broken (it is stepping the family down): a shadow yields."""
        state = getattr(self.adapt, "state", None)
        return getattr(state, "over_since", None) is not None

    def _keep_previous(self) -> bool:
        """May a replaced model stay loaded: configured so, overlap swaps, and memory to spare."""
        cfg = self.config.deployments
        if not (cfg.keep_previous_loaded and cfg.swap_strategy == "overlap"):
            return False
        return psutil.virtual_memory().available / 2**20 >= cfg.min_free_memory_mb

    # --- events -------------------------------------------------------------------------------

    def emit(self, type_: str, **fields: Any) -> None:
        """Record an event in the state store (now or later) and hand it to every sink (MQTT, socket followers)."""
        store = self.store
        if store is not None:
            try:
                self.storage.defer(f"event {type_}", store.quick(lambda: store.add_event(type_, fields)), event=True)
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
        """Open state, recover deployments, load the model, start worker, camera and deployer. No storage fault ends
        it (agent.storage_health): writes wait, reads are waited for, a stop meanwhile returns early."""
        cfg = self.config
        limit_opencv_threads(cfg.pipeline.opencv_threads)
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        sample_dir = live_frames_dir(cfg)
        if sample_dir is not None:
            self.live_frames = LiveFrameSampler(sample_dir, cfg.gates.live_frames, int(cfg.gates.live_frames_max_mb * 2**20),
                                                cfg.gates.live_frames_interval_s)
            self.live_frames.start()
        self.store, shed = open_state_store(cfg.state_dir, sample_dir, self.stop_event, self.waits.say)
        self._startup_reclaimed = shed.to_dict() if shed is not None else None
        if self.store is None:
            return  # stopped while waiting for the state store
        dispatcher = self._make_parts(self.store)
        self.plane = AgentPlane(self)  # before the first write, so start-up events (a failed write's too) reach MQTT
        self.event_sinks.append(self.plane.on_event)
        self.tracking = self.tracking.start(cfg, self.store, self.emit, self.result_sinks)  # [tracking]: sink first
        self.plane.start()
        self._record_start()
        if self.store.recovered:  # into the outbox now, on the broker at the next connect
            self.emit("state_db_quarantined", **self.store.recovered)
        if self._startup_reclaimed:
            self.emit("storage_reclaimed", at="start", **self._startup_reclaimed)
        # the deployment manager writes to the store when made: one the store refuses now is made once it takes writes
        deployments_ready = self.storage.attempt("deployment manager", self._make_deployments)
        if not self.waits.until_done("the first model", self._load_initial) or self.active is None:
            return
        active = self.active
        self.plane.model_changed(active.describe())
        self.video = self._video_service()
        self._register_result_sinks()
        self._start_frame_path()
        self.video.start()
        self._adapt_do(lambda host: host.restart())  # a family: its other variants build in the background
        if deployments_ready and self.manager is not None:
            self.manager.start()
        else:  # made and started once the store takes writes; frames are served meanwhile
            self._late_deployments = threading.Thread(target=self._deployments_later, name="deploy-wait", daemon=True)
            self._late_deployments.start()
        self.control_server = ControlSocketServer(cfg.control_socket_path(), dispatcher.dispatch, cfg.control.group)
        self.control_server.start()
        self.state = "running"
        self.watchdog = ProgressWatchdog(self.notifier, lambda: self.worker.heartbeat if self.worker else 0)
        self.watchdog.start()
        self.notifier.ready(f"serving {active.source.label}")
        self.persist_live()

    def _make_parts(self, store: StateStore) -> CommandDispatcher:
        """Deployment records, loader, adaptation, shadow and the command dispatcher (returned) over `store`."""
        cfg = self.config
        self.deployments = DeploymentStore(store)
        self.loader = ModelLoader(cfg, self.stop_event, index_writable=lambda: not self.storage.degraded)
        self.adapt_host = AdaptHost(self.slots, self.loader, cfg.adapt, cfg.engines.validation_samples, self.emit,
                                    store, self._sample_telemetry)
        self.shadow_host = ShadowHost(self.slots, self.loader, cfg.deployments, self._throttled, self._adapt_over_limit)
        self.dispatcher = CommandDispatcher(AgentController(self, on_set_config=self._set_live_config),
                                            state_db_path(cfg.state_dir), max_payload_bytes=cfg.mqtt.max_payload_bytes,
                                            deploy_rate=RateLimit(cfg.deployments.max_requests_per_minute, 60.0))
        return self.dispatcher

    def _make_deployments(self) -> None:
        """The deployment manager (it writes its version memory) and the recovery of interrupted deployments."""
        store, cfg, deployed = self.store, self.config, self.config.state_dir / "artifacts" / "deployed"
        assert store is not None and self.deployments is not None and self.loader is not None
        with store.busy_timeout(QUICK_BUSY_TIMEOUT_S):  # a lock is waited out around this call, not in it
            self.manager = self.manager or DeploymentManager(self.deployments, self, deployed, self.loader.artifacts,
                                                             cfg.deployments, self.emit, self.stop_event)
            self.manager.recover()

    def _deployments_later(self) -> None:
        """The deployment manager the store refused at start, once it takes writes (a request before is refused)."""
        if self.waits.until_done("the deployment manager", self._make_deployments) and not self.stop_event.is_set():
            assert self.manager is not None
            self.manager.start()

    def _record_start(self) -> None:
        """The run's row and the first live status: now, or when the store takes them (agent.storage_health)."""
        store = self.store
        assert store is not None
        self.storage.defer("run record", store.quick(lambda: setattr(self, "run_id", store.start_run(os.getpid()))))
        self.storage.defer("live status", store.quick(lambda: store.set_kv(LIVE_KEY, {"ts": time.time(),
                                                                                     "state": "starting"})))

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
        self.tracking.camera_restarted(camera)  # its track ids start again, and a tracks_reset event says so

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

    def swap_model(self, loaded: LoadedModel) -> None:
        """Swap `loaded` in between two batches, with the batch size re-resolved from its curve (deployments,
        rollbacks and adapt switches all come here; a 640x480 and a 320x224 variant can pick different sizes)."""
        assert self.worker is not None
        size = self._batch_size_for(loaded)
        self.worker.swap(loaded.runtime, batch_size=size.size, tuner=self._tuner_for(loaded, size))
        plane = self.plane  # read once: stop() clears it
        if plane is not None:  # the retained meta names what serves
            plane.model_changed(loaded.describe())
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

    def _load_initial(self) -> None:
        """The model to serve first (the active one when it still verifies); its records may wait for the store."""
        assert self.loader is not None and self.store is not None
        store = self.store
        source, origin = self.loader.initial_source(store.model_slot("active"), self.emit)
        choice = choose_backend("auto").to_dict() if self.config.model.backend == "auto" else None
        self.storage.defer("backend choice", store.quick(lambda: store.set_kv(BACKEND_KEY, choice)))  # for `status`
        if choice:
            self.emit("backend_selected", **choice)
        loaded = self.loader.load(source, origin, on_progress=self._engine_progress)
        self.storage.defer("active model", store.quick(lambda: self._record_active(loaded)))
        self.emit("model_loaded", model=loaded.describe(), origin=origin)
        log.info("model %s loaded on %s (%s, cache %s)", source.label, loaded.describe()["backend"],
                 loaded.describe()["precision"], "hit" if loaded.provisioned.hit else "miss")
        self.active = loaded

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

    def _register_result_sinks(self) -> None:
        """Every consumer of a served frame's result, in the order they get it (agent.daemon.result_sinks)."""
        sinks, plane, live_frames, video = self.result_sinks, self.plane, self.live_frames, self.video
        sinks.add("record", self._record_result)
        if self.adapt_host is not None:
            sinks.add("adapt", self.adapt_host.on_result)
        sinks.add("output_health", lambda frame, result, runtime: self.output_health.record(frame.source, result, runtime))
        if live_frames is not None:
            sinks.add("live_frames", lambda frame, result, runtime: live_frames.offer(frame.source, frame.image))
        if video is not None:
            sinks.add("video", lambda frame, result, runtime: video.offer(  # with the frame's tracks
                frame.source, frame.index, frame.image, result, frame.captured_at, runtime, self.tracking.of(frame)))
        if plane is not None:  # masks' run lengths only for the results the rate limit lets out
            sinks.add("mqtt", self.tracking.results_sink(plane.on_result, _result_head))  # with track ids
        sinks.add("shadow", self._offer_shadow)  # last: a share of the frames, into a one-slot mailbox; never waits

    def _record_result(self, frame: Frame, result: Any, runtime: Any) -> None:
        self._delivered.append(time.monotonic())
        self.last_result = {**_result_head(frame), **result.to_dict(max_items=20, masks=False)}  # nothing costly
        self._recent_results.append(self.last_result)

    def _offer_shadow(self, frame: Frame, result: Any, runtime: Any) -> None:
        shadow = self.shadow  # read once: the deployment thread detaches it when the shadow ends
        if shadow is not None:
            shadow.offer(frame.source, frame.image, frame.captured_at, result, runtime)

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

    def stop(self) -> dict[str, Any]:
        """Stop threads in reverse start order, close models and the store; returns the summary."""
        self.notifier.stopping("stopping")
        if self.watchdog is not None:
            self.watchdog.stop()
        self.stop_event.set()
        if self._late_deployments is not None:  # first: it may start the manager, joined below
            self._late_deployments.join(QUICK_BUSY_TIMEOUT_S + JOIN_TIMEOUT_S)
        self._adapt_do(lambda host: host.halt())
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
        self.tracking.stop()  # no more results: its last events reach the outbox before the plane stops
        summary = self.summary()
        self._adapt_do(lambda host: host.stop())
        if self.plane is not None:
            self.plane.stop()
            self.plane = None
        self.slots.close()
        if self.dispatcher is not None:
            self.dispatcher.close()
        if self.store is not None:
            self.storage.close(flush=True)  # what waited for the store: one last try, the log names what is lost
            with self.storage.guard("run summary"):
                if self.run_id is not None:
                    self.store.finish_run(self.run_id, summary)
                self.store.set_kv(LIVE_KEY, {"ts": time.time(), "state": "stopped"})
            self.store.close()
            self.store = None
        self.state = "stopped"
        return summary

    # --- SwapHost (called from the deployment worker) ------------------------------------------

    def reclaim_space(self) -> dict[str, Any]:
        """A full disk: shed failed downloads, unused artifacts, the live-frame sample, other models' engines
        and the oldest half of the outbox's telemetry (agent.storage_reclaim); a `storage_reclaimed` event."""
        result = reclaim_running(self.config.state_dir / "artifacts" / "deployed", live_frames_dir(self.config),
                                 self.store.serving_models() if self.store is not None else None,
                                 lambda pinned: self.collect_engines(pinned, 0),
                                 self.plane.mqtt.outbox if self.plane is not None else None)
        self.emit("storage_reclaimed", **result.to_dict())
        return result.to_dict()

    def collect_engines(self, pinned: set[str], budget_bytes: int | None = None) -> Any:
        """Engine cache GC, never the `pinned` models' engines: after a deployment to `[engines]
        cache_budget_mb`, on a full disk to 0. Returns the cache's GcReport."""
        budget = self.config.engines.cache_budget_mb * 2**20 if budget_bytes is None else budget_bytes
        return collect_engines(self.config.cache_dir, state_db_path(self.config.state_dir), pinned, budget,
                               self._engine_progress)


def _status_text(type_: str, fields: dict[str, Any]) -> str:
    """One short STATUS= line for `systemctl status`."""
    if type_ == "deployment":
        return f"deployment {fields.get('deployment_id')}: {fields.get('state')}"
    return f"{type_} {fields.get('camera') or fields.get('reason') or ''}".strip()


def _result_head(frame: Frame) -> dict[str, Any]:
    """What names a result: its camera and frame, and for a file source which file it was."""
    return {"camera": frame.source, "frame": frame.index, **{k: frame.meta[k] for k in RESULT_META if k in frame.meta}}
