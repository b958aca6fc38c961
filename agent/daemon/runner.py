"""The daemon's composition root: state store, model, frame path (agent.pipeline: cameras -> batcher ->
inference worker), deployments, MQTT plane and control socket — started in order, stopped in reverse.

With `[models.NAME]` (per-camera models) what acts on the serving model sees `[model]`'s cameras only
(`AgentConfig.lane_config()`); each other model serves its cameras on a lane (agent.daemon.model_lanes)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import psutil

from agent.adapt.controller import AdaptController
from agent.config.tree import AgentConfig
from agent.control.commands import CommandDispatcher
from agent.control.control_socket import ControlSocketServer
from agent.control.rate_limit import RateLimit
from agent.daemon.adapt_host import AdaptHost
from agent.daemon.control import AgentController, ControlParts
from agent.daemon.frame_path import RECENT_FPS_WINDOW_S, FramePath, result_head
from agent.daemon.model_lanes import ModelLanes
from agent.daemon.model_loading import ModelLoader, live_frames_dir
from agent.daemon.plane import AgentPlane
from agent.daemon.reporting import LiveParts, LiveReport, LiveSnapshot
from agent.daemon.result_sinks import ResultSinks
from agent.daemon.shadow_host import ShadowHost
from agent.daemon.swaps import Swaps, collect_engine_cache, record_active
from agent.daemon.tracking_host import IDLE, TrackingHost
from agent.deployments.manager import DeploymentManager
from agent.deployments.store import DeploymentStore
from agent.pipeline.live_frame_sampler import LiveFrameSampler
from agent.pipeline.batch_size import BatchSize
from agent.pipeline.batcher import Batcher
from agent.pipeline.cameras import CameraGroup
from agent.pipeline.frame_stats import FrameStats
from agent.pipeline.output_health import OutputHealth
from agent.pipeline.worker import InferenceWorker, limit_opencv_threads
from agent.base.sdnotify import Notifier, ProgressWatchdog
from agent.shadow.session import ShadowSession
from agent.serving.slots import LoadedModel, ModelSlots
from agent.sources.base import Frame
from agent.storage.state import BACKEND_KEY, LIVE_KEY, QUICK_BUSY_TIMEOUT_S, StateStore, state_db_path
from agent.storage.health import StartWaits, StorageHealth
from agent.storage.reclaim import free_bytes, open_state_store, reclaim_running
from agent.video.service import VideoService
from engines.postprocess import InferenceResult
from engines.runtime.model_runtime import ModelRuntime, choose_backend

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 2.0
SHADOW_STOP_S = 15.0  # a candidate still loading when the agent stops finishes its load first
EventSink = Callable[..., None]


class Agent:
    """Owns the parts of one run; `start`, then `wait`, then `stop`. It builds each part and hands it only what it
    uses (a part, a callable, a Protocol the part declares): no part receives the agent."""

    def __init__(self, config: AgentConfig, on_event: EventSink | None = None) -> None:
        self.config = config
        self.stop_event = threading.Event()
        self.store: StateStore | None = None
        self.deployments: DeploymentStore | None = None
        self.manager: DeploymentManager | None = None
        self.loader: ModelLoader | None = None
        self.swaps: Swaps | None = None  # the deployment manager's side of a swap (agent.daemon.swaps)
        self.slots = ModelSlots(self.swap_model, self._keep_previous)  # active, previous, their lock
        self.shadow_host: ShadowHost | None = None  # a shadow deployment's candidate while it runs (agent.shadow)
        self.adapt_host: AdaptHost | None = None  # the active family's controller (docs/adaptive.md)
        self.output_health = OutputHealth()  # per camera: what the serving model finds (the watch's collapse check)
        # state-store writes that fail (a lock, a full disk) are never fatal: they wait; a full disk is shed from
        self.storage = StorageHealth(self.emit, self.reclaim_space, lambda: free_bytes(config.state_dir),
                                     str(config.state_dir))
        self.live_frames: LiveFrameSampler | None = None  # [gates] live_frames: recent camera frames for the gates
        self.video: VideoService | None = None  # [video]: MJPEG, stream, snapshots (agent.video)
        # [tracking] (agent.daemon.tracking_host): idle until the start, and while off
        self.tracking: TrackingHost = IDLE
        self._startup_reclaimed: dict[str, Any] | None = None  # what a nearly full disk cost at start
        self._late_deployments: threading.Thread | None = None  # makes the deployment manager the store refused
        self.result_sinks = ResultSinks()  # each result: the record, adaptation, health, video, MQTT, shadow
        # [model]'s cameras (all of them without [models]): what the frame path, the loader and the swaps plan for
        self.serving_config = config.lane_config()
        self.frame_path = FramePath(self.serving_config, self.stop_event, self.emit, self.result_sinks,
                                    on_camera_restart=lambda camera: self.tracking.camera_restarted(camera))
        # [models.NAME] in use, each on its own cameras (agent.daemon.model_lanes); empty without [models]
        self.lanes = ModelLanes(config, self.stop_event, self.emit,
                                on_camera_restart=lambda camera: self.tracking.camera_restarted(camera))
        self.report = LiveReport(self.frame_path, self.storage, self.result_sinks, LiveParts(
            active=lambda: self.slots.active, deployment=lambda: self.manager.status() if self.manager else None,
            adapt=lambda: self.adapt, shadow=lambda: self.shadow, live_frames=lambda: self.live_frames,
            video=lambda: self.video, tracking=lambda: self.tracking, lanes=self.lanes.views))
        self.control_parts = ControlParts(  # what the commands reach (agent.daemon.control)
            config=config, stop_event=self.stop_event, emit=self.emit, live_snapshot=self.report.live_snapshot,
            restart_capture=self.restart_capture, store=lambda: self.store,
            deployments=lambda: self.deployments, manager=lambda: self.manager, previous=lambda: self.slots.previous,
            adapt=lambda: self.adapt, video=lambda: self.video, dispatcher=lambda: self.dispatcher,
            tracking=lambda: self.tracking)
        self.dispatcher: CommandDispatcher | None = None
        self.plane: AgentPlane | None = None
        self.control_server: ControlSocketServer | None = None
        self.notifier = Notifier()
        self.waits = StartWaits(self.storage, self.stop_event, self.notifier)  # a store it cannot use yet
        self.watchdog: ProgressWatchdog | None = None
        self.run_id: int | None = None
        self.event_sinks: list[EventSink] = [on_event] if on_event else []
        self.state = "starting"

    # --- the frame path (agent.daemon.frame_path) and the model slots (agent.serving.slots) ---------------

    @property
    def stats(self) -> FrameStats:
        """The run's frame counters (fresh when the frame path starts)."""
        return self.frame_path.stats

    @property
    def batcher(self) -> Batcher[Frame] | None:
        """Frames from the cameras' mailboxes into batches."""
        return self.frame_path.batcher

    @property
    def batch_size(self) -> BatchSize | None:
        """The batch size in use and why."""
        return self.frame_path.batch_size

    @property
    def worker(self) -> InferenceWorker | None:
        """The inference loop."""
        return self.frame_path.worker

    @property
    def cameras(self) -> CameraGroup | None:
        """The capture threads."""
        return self.frame_path.cameras

    @property
    def last_result(self) -> dict[str, Any] | None:
        """The last result delivered (without masks)."""
        return self.frame_path.last_result

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

    @property
    def shadow(self) -> ShadowSession | None:
        """The running shadow session, if any (the deployment thread detaches it when the shadow ends)."""
        return self.shadow_host.session if self.shadow_host is not None else None

    def _sample_telemetry(self) -> dict[str, Any]:
        """One telemetry reading from the plane's collector (the agent's one jtop/NVML client); {} without one."""
        plane = self.plane
        return plane.telemetry.collector.sample() if plane is not None else {}

    def _throttled(self) -> bool:
        """The device throttles now (the telemetry's throttle counters moved): a shadow yields."""
        plane = self.plane
        return plane is not None and plane.telemetry.throttled

    def _adapt_over_limit(self) -> bool:
        """The adaptive policy sees a limit broken (it is stepping the family down): a shadow yields."""
        adapt = self.adapt
        return adapt is not None and adapt.state is not None and adapt.state.over_since is not None

    def _keep_previous(self) -> bool:
        """May a replaced model stay loaded: configured so, overlap swaps, and memory to spare."""
        cfg = self.config.deployments
        if not (cfg.keep_previous_loaded and cfg.swap_strategy == "overlap"):
            return False
        return psutil.virtual_memory().available / 2**20 >= cfg.min_free_memory_mb

    # --- what it says about itself (agent.daemon.reporting) --------------------------------------

    def live_snapshot(self) -> LiveSnapshot:
        """The live numbers now: what status, telemetry, the live record and the summary are made from."""
        return self.report.live_snapshot()

    def summary(self) -> dict[str, Any]:
        """The run summary of docs/contract.md."""
        return self.live_snapshot().summary()

    def health(self) -> str:
        """online, degraded or updating."""
        return self.live_snapshot().health

    def recent_fps(self, window_s: float = RECENT_FPS_WINDOW_S) -> float:
        """Results delivered per second over the last `window_s` (agent.daemon.frame_path)."""
        return self.frame_path.recent_fps(window_s)

    def persist_live(self, snap: LiveSnapshot | None = None) -> None:
        """Write the live numbers where `edge-agent status` (another process) can read them: `snap`, the tick's
        snapshot when the caller took one (the run's live view shows the same), else one taken now."""
        store, plane = self.store, self.plane
        if store is None:
            return
        snap = snap if snap is not None else self.live_snapshot()
        if plane is not None:
            plane.health_changed(snap.health)
        with self.storage.guard("live status"):
            store.set_kv(LIVE_KEY, snap.live_record())

    # --- events -------------------------------------------------------------------------------

    def emit(self, type_: str, **fields: object) -> None:
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
        it (agent.storage.health): writes wait, reads are waited for, a stop meanwhile returns early."""
        cfg = self.config
        limit_opencv_threads(cfg.pipeline.opencv_threads)
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        sample_dir = live_frames_dir(cfg)
        if sample_dir is not None:
            self.live_frames = LiveFrameSampler(sample_dir, cfg.gates.live_frames,
                                                int(cfg.gates.live_frames_max_mb * 2**20),
                                                cfg.gates.live_frames_interval_s)
            self.live_frames.start()
        self.store, shed = open_state_store(cfg.state_dir, sample_dir, self.stop_event, self.waits.say)
        self._startup_reclaimed = shed.to_dict() if shed is not None else None
        if self.store is None:
            return  # stopped while waiting for the state store
        dispatcher = self._make_parts(self.store)
        # before the first write, so start-up events (a failed write's too) reach MQTT
        self.plane = AgentPlane(cfg, self.store, dispatcher.dispatch, self.report, self.storage, self.emit)
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
        self.frame_path.start(active)
        self.video.start()
        # [models.NAME] load while [model]'s cameras are served already (a TensorRT build takes minutes)
        if self.lanes and not self.waits.until_done("the per-camera models", self._load_lanes):
            return
        self.lanes.start()
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
        """Deployment records, loader, adaptation, shadow, swaps and the command dispatcher (returned) over `store`."""
        cfg = self.config
        self.deployments = DeploymentStore(store)
        self.loader = ModelLoader(self.serving_config, self.stop_event, index_writable=self._index_writable)
        self.adapt_host = AdaptHost(self.slots, self.loader, cfg.adapt, cfg.engines.validation_samples, self.emit,
                                    store, self._sample_telemetry)
        self.shadow_host = ShadowHost(self.slots, self.loader, cfg.deployments, self._throttled, self._adapt_over_limit)
        self.swaps = Swaps(self.serving_config, self.slots, self.frame_path, self.loader, store, self.shadow_host,
                           self.adapt_host, self.output_health, self.emit, self.stop_event, self._engine_progress,
                           also_pinned=self.lanes.pinned)
        self.dispatcher = CommandDispatcher(AgentController(self.control_parts, on_set_config=self._set_live_config),
                                            state_db_path(cfg.state_dir), max_payload_bytes=cfg.mqtt.max_payload_bytes,
                                            deploy_rate=RateLimit(cfg.deployments.max_requests_per_minute, 60.0))
        return self.dispatcher

    def _make_deployments(self) -> None:
        """The deployment manager (it writes its version memory) and the recovery of interrupted deployments."""
        store, cfg, deployed = self.store, self.config, self.config.state_dir / "artifacts" / "deployed"
        assert store is not None and self.deployments is not None and self.loader is not None and self.swaps is not None
        with store.busy_timeout(QUICK_BUSY_TIMEOUT_S):  # a lock is waited out around this call, not in it
            self.manager = self.manager or DeploymentManager(self.deployments, self.swaps, deployed,
                                                             self.loader.artifacts, cfg.deployments, self.emit,
                                                             self.stop_event)
            self.manager.recover()

    def _deployments_later(self) -> None:
        """The deployment manager the store refused at start, once it takes writes (a request before is refused)."""
        if self.waits.until_done("the deployment manager", self._make_deployments) and not self.stop_event.is_set():
            assert self.manager is not None
            self.manager.start()

    def _record_start(self) -> None:
        """The run's row and the first live status: now, or when the store takes them (agent.storage.health)."""
        store = self.store
        assert store is not None
        self.storage.defer("run record", store.quick(lambda: setattr(self, "run_id", store.start_run(os.getpid()))))
        self.storage.defer("live status", store.quick(lambda: store.set_kv(LIVE_KEY, {"ts": time.time(),
                                                                                     "state": "starting"})))

    def _adapt_do(self, action: Callable[[AdaptHost], Any]) -> None:
        if self.adapt_host is not None:
            action(self.adapt_host)

    def _video_service(self) -> VideoService:
        """`[video]`: the tap always (snapshots need it; it costs nothing unwatched), server and stream when set."""
        cfg, plane = self.config, self.plane
        mqtt = plane.mqtt if plane is not None else None
        return VideoService(cfg.video, cfg.device_id, [c.name for c in cfg.camera_list()],
                            mqtt.publish_snapshot if mqtt is not None else None, self.emit,
                            mqtt.topics.snapshot if mqtt is not None else None)

    def swap_model(self, loaded: LoadedModel) -> None:
        """Swap `loaded` in between two batches, with the batch size re-resolved from its curve (deployments,
        rollbacks and adapt switches all come here, through the model slots)."""
        self.frame_path.swap(loaded)
        plane = self.plane  # read once: stop() clears it
        if plane is not None:  # the retained meta names what serves
            plane.model_changed(loaded.describe())

    def restart_capture(self, camera: str | None = None) -> dict[str, Any]:
        """Reopen every camera, or only `camera` (the `restart_pipeline` command; agent.daemon.frame_path), on the
        frame path that serves it."""
        if not self.lanes:
            return self.frame_path.restart_capture(camera)
        return self.lanes.restart_capture(self.frame_path, camera)

    def _index_writable(self) -> bool:
        return not self.storage.degraded

    def _load_lanes(self) -> None:
        """Each `[models.NAME]` in use (agent.daemon.model_lanes); a storage wait retries only those not loaded."""
        self.lanes.load(self._index_writable, self._engine_progress)

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
        self.storage.defer("active model", store.quick(lambda: record_active(store, loaded)))
        self.emit("model_loaded", model=loaded.describe(), origin=origin)
        log.info("model %s loaded on %s (%s, cache %s)", source.label, loaded.describe()["backend"],
                 loaded.describe()["precision"], "hit" if loaded.provisioned.hit else "miss")
        self.active = loaded

    def _engine_progress(self, event: dict[str, Any]) -> None:
        """Engine cache/build/validation progress of the start-up model, as `engine` events."""
        fields = {k: v for k, v in event.items() if k != "type"}
        self.notifier.extend_timeout(120)  # a TensorRT build on a cache miss outlasts TimeoutStartSec
        self.emit("engine", event=event.get("type", "progress"), **fields)

    def _register_result_sinks(self) -> None:
        """Every consumer of a served frame's result, in the order they get it (agent.daemon.result_sinks)."""
        sinks, plane, live_frames, video = self.result_sinks, self.plane, self.live_frames, self.video
        sinks.add("record", self.frame_path.record_result)
        if self.adapt_host is not None:
            sinks.add("adapt", self.adapt_host.on_result)
        sinks.add("output_health",
                  lambda frame, result, runtime: self.output_health.record(frame.source, result, runtime))
        if live_frames is not None:
            sinks.add("live_frames", lambda frame, result, runtime: live_frames.offer(frame.source, frame.image))
        if video is not None:
            sinks.add("video", lambda frame, result, runtime: video.offer(  # with the frame's tracks
                frame.source, frame.index, frame.image, result, frame.captured_at, runtime, self.tracking.of(frame)))
        if plane is not None:  # masks' run lengths only for the results the rate limit lets out
            sinks.add("mqtt", self.tracking.results_sink(plane.on_result, result_head))  # with track ids
        sinks.add("shadow", self._offer_shadow)  # last: a share of the frames, into a one-slot mailbox; never waits
        self.lanes.register_sinks(plane, self.video, self.tracking)

    def _offer_shadow(self, frame: Frame, result: InferenceResult, runtime: ModelRuntime) -> None:
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
        self.lanes.close_intake()
        if self.control_server is not None:
            self.control_server.stop()
            self.control_server = None
        if self.video is not None:
            self.video.stop()
        if self.cameras is not None:
            self.cameras.stop(JOIN_TIMEOUT_S)
        self.lanes.stop_cameras(JOIN_TIMEOUT_S)
        if self.live_frames is not None:
            self.live_frames.close()
        self._join_workers()
        self.lanes.join(JOIN_TIMEOUT_S)
        self.tracking.stop()  # no more results: its last events reach the outbox before the plane stops
        summary = self.summary()
        self._adapt_do(lambda host: host.stop())
        if self.plane is not None:
            self.plane.stop()
            self.plane = None
        self.slots.close()
        self.lanes.close()
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

    def _join_workers(self) -> None:
        """The deployment thread and the inference loop; a shadow ends on the deployment thread, which closes the
        candidate and records why: it is waited for longer."""
        for thread in (self.manager, self.worker):
            if thread is not None and thread.is_alive():
                thread.join(SHADOW_STOP_S if thread is self.manager and self.shadow is not None else JOIN_TIMEOUT_S)
                if thread.is_alive():
                    log.error("thread %s did not stop within %.1f s", thread.name, JOIN_TIMEOUT_S)

    def reclaim_space(self) -> dict[str, Any]:
        """A full disk: shed failed downloads, unused artifacts, the live-frame sample, other models' engines
        and the oldest half of the outbox's telemetry (agent.storage.reclaim); a `storage_reclaimed` event."""
        result = reclaim_running(self.config.state_dir / "artifacts" / "deployed", live_frames_dir(self.config),
                                 self.store.serving_models() if self.store is not None else None,
                                 lambda pinned: collect_engine_cache(self.config, pinned | self.lanes.pinned(), 0,
                                                                     self._engine_progress),
                                 self.plane.mqtt.outbox if self.plane is not None else None)
        self.emit("storage_reclaimed", **result.to_dict())
        return result.to_dict()


def _status_text(type_: str, fields: dict[str, Any]) -> str:
    """One short STATUS= line for `systemctl status`."""
    if type_ == "deployment":
        return f"deployment {fields.get('deployment_id')}: {fields.get('state')}"
    return f"{type_} {fields.get('camera') or fields.get('reason') or ''}".strip()
