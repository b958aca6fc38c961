"""The agent's side of a deployment (the SwapHost agent.deployments.manager drives): provision a candidate, swap it
in between two frames, watch it, commit it or roll back, and run it as a shadow first.

A part of the daemon: it receives what it uses -- the model slots, the frame path, the loader, the state store, the
shadow and adaptation hosts, the output-health window -- never the agent. Every change of the serving model goes
through the model slots (agent.serving.slots) under their lock; adaptation is stopped for the swap and restarted (held
until the watch passes) after it.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from agent.config.tree import AgentConfig
from agent.daemon.adapt_host import AdaptHost
from agent.daemon.frame_path import FramePath
from agent.daemon.model_loading import ModelLoader
from agent.daemon.shadow_host import ShadowHost
from agent.deployments import watch as deployment_watch
from agent.deployments.floors import FpsFloor, capacity_fps, fps_floors, refuse_unmeetable
from agent.deployments.stage_watch import StageWatch
from agent.deployments.store import Deployment, DeploymentStore
from agent.pipeline.batch_size import batch_curve, stated_fps
from agent.pipeline.output_health import OutputHealth
from agent.shadow.plan import ShadowPlan
from agent.shadow.session import ShadowSession
from agent.shadow.verdict import Verdict
from agent.serving.slots import LoadedModel, ModelSlots
from agent.storage.state import StateStore, state_db_path, validation_brief
from agent.storage.reclaim import collect_engines
from engines.cascade.serving import PipelineRuntime
from engines.runtime.provisioned import ProvisionResult
from kernel.errors import EdgeError
from engines.model.source import ModelSource

if TYPE_CHECKING:
    from engines.build.cache import GcReport  # the cache module is loaded when a GC runs (agent.storage.reclaim)

log = logging.getLogger(__name__)
Progress = Callable[[dict[str, Any]], None]


class Swaps:
    """Deployments, rollbacks and shadows on the running agent; `last_swap` is what the latest swap measured."""

    def __init__(self, config: AgentConfig, slots: ModelSlots, frame_path: FramePath, loader: ModelLoader,
                 store: StateStore, shadow_host: ShadowHost, adapt_host: AdaptHost, output_health: OutputHealth,
                 emit: Callable[..., None], stop_event: threading.Event, on_engine_progress: Progress,
                 also_pinned: Callable[[], set[str]] = set) -> None:
        self.config, self.slots, self.frame_path, self.loader, self.store = config, slots, frame_path, loader, store
        self.shadow_host, self.adapt_host, self.output_health = shadow_host, adapt_host, output_health
        self.emit, self.stop_event, self.on_engine_progress = emit, stop_event, on_engine_progress
        self.also_pinned = also_pinned  # the [models.NAME] lanes' engines (agent.daemon.model_lanes)
        self.last_swap: dict[str, Any] = {}

    def fps_floors(self, source: ModelSource, provisioned: ProvisionResult) -> dict[str, FpsFloor]:
        """Each camera's fps floor under `source`: from its own gate-measured capacity at the batch size it
        will run at and the cameras' stated rates, or an absolute floor (agent.deployments.floors)."""
        size = self.frame_path.batch_size_of(source, provisioned).size
        capacity = capacity_fps(provisioned.validation, batch_curve(provisioned), size)
        rates = {camera.name: stated_fps(camera) for camera in self.config.camera_list()}
        return fps_floors(self.config.deployments, source.manifest.gates.min_fps, capacity, rates)

    def provision(self, source: ModelSource, on_progress: Progress, stop: threading.Event) -> ProvisionResult:
        """Engine for `source`: cached or built in a child process, then validated."""
        provisioned = self.loader.provision(source, on_progress, stop)
        refuse_unmeetable(self.fps_floors(source, provisioned))  # GATE_FPS now, not WATCH_FPS after the swap
        return provisioned

    def activate(self, source: ModelSource, provisioned: ProvisionResult, dep: Deployment) -> dict[str, Any]:
        """Swap the candidate in between two frames, by the configured strategy; returns what happened."""
        worker = self.frame_path.worker
        assert worker is not None
        strategy = self.config.deployments.swap_strategy
        self.adapt_host.stop()  # a deployment replaces the whole family: no variant switch during the swap
        with self.slots.lock:
            fps_before = worker.window.fps()
            fps_cameras = {name: round(w.fps(), 2) for name, w in worker.camera_windows.items()}
            before = worker.last_result_at
            if strategy == "overlap":
                candidate = self.loader.load_provisioned(source, provisioned, "deployment")
                self.slots.swap(candidate)
            else:
                candidate = self._stop_start(source, provisioned)
            gap_ms = self._measure_gap(before)
            self.slots.activate(candidate)
        self.adapt_host.restart(hold=True)  # no variant build or switch until the watch passed (watch)
        self.last_swap = {"strategy": strategy, "gap_ms": gap_ms, "fps_before": round(fps_before, 2),
                          "fps_before_cameras": fps_cameras, "previous_loaded": self.slots.previous is not None}
        return dict(self.last_swap)

    def _stop_start(self, source: ModelSource, provisioned: ProvisionResult) -> LoadedModel:
        """Free the active engine first (devices that cannot hold two), then load the candidate."""
        worker = self.frame_path.worker
        assert worker is not None and self.slots.active is not None
        worker.pause()
        try:
            self.slots.active.runtime.close()
            try:
                candidate = self.loader.load_provisioned(source, provisioned, "deployment")
            except Exception:
                restored = self.loader.reload(self.slots.active)  # the old engine must come back
                self.slots.swap(restored)
                self.slots.active = restored
                raise
            self.slots.swap(candidate)
        finally:
            worker.resume()
        self.slots.active.closed = True
        return candidate

    def _measure_gap(self, before: float | None, timeout: float = 30.0) -> float | None:
        """Time from the last result of the old model to the first result of the new one."""
        worker = self.frame_path.worker
        assert worker is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop_event.is_set():
            first_new = worker.window.opened_at  # the new model's first result
            if first_new is not None:
                return None if before is None else round((first_new - before) * 1e3, 1)
            time.sleep(0.005)
        return None

    def commit_active(self, source: ModelSource, provisioned: ProvisionResult, dep: Deployment,
                      store: DeploymentStore) -> None:
        """The new active model and the deployment's `active` state, in one transaction."""
        assert self.slots.active is not None
        with self.store.transaction(durable=True):
            record_active(self.store, self.slots.active, dep.id)
            store.apply(dep, "active")

    def watch(self, dep: Deployment, stop: threading.Event, window_s: float) -> dict[str, Any] | None:
        """Judge the new model for `window_s` (the watch window, or what a stop left of it); the first violation
        (with numbers) or None."""
        worker, cameras = self.frame_path.worker, self.frame_path.cameras
        assert worker is not None and cameras is not None and self.slots.active is not None
        budget = self.slots.active.source.manifest.gates.latency_budget_ms
        floors = self.fps_floors(self.slots.active.source, self.slots.active.provisioned)
        stages = stage_watch(self.slots.active)
        violation = deployment_watch.watch_model(
            worker, cameras, self.config.deployments, budget, stop, floors,
            still_current=lambda: self.slots.active is not None and self.slots.active.deployment_ok(dep),
            health=self.output_health, window_s=window_s, stages=stages)
        if violation is not None:
            violation["swap_gap_ms"] = self.last_swap.get("gap_ms")
            return violation
        if not stop.is_set() and self.slots.active.deployment_ok(dep):
            self.emit("watch_passed", deployment_id=dep.id, swap_gap_ms=self.last_swap.get("gap_ms"),
                      **deployment_watch.watch_summary(worker, floors, self.output_health, stages))
        self.adapt_host.release()  # the new family builds its variants and switches only now
        return None

    def start_shadow(self, source: ModelSource, provisioned: ProvisionResult, dep: Deployment, plan: ShadowPlan,
                     on_verdict: Callable[[Verdict], None]) -> ShadowSession:
        """A shadow deployment's candidate beside the serving model (agent.daemon.shadow_host)."""
        return self.shadow_host.start(source, provisioned, dep, plan, on_verdict)

    def check_shadow(self, source: ModelSource) -> None:
        """Refuse a shadow that could compare nothing (SHADOW_INCOMPARABLE)."""
        self.shadow_host.check_comparable(source)

    def stop_shadow(self, session: ShadowSession) -> None:
        """The shadow gets no more frames; its engine is closed."""
        self.shadow_host.stop(session)

    def serving_label(self) -> str:
        """name@version of the serving model."""
        return self.slots.serving_label()

    def rollback(self, reason: str, numbers: dict[str, Any] | None = None) -> dict[str, Any]:
        """Back to the previous model: instant when it is still loaded, else loaded again from its artifact."""
        worker = self.frame_path.worker
        assert worker is not None
        self.adapt_host.stop()  # back to the previous family, at the variant kept loaded for it
        with self.slots.lock:
            row = self.store.model_slot("previous")
            if row is None:
                raise EdgeError("no previous model to roll back to", code="NO_PREVIOUS_MODEL")
            started = time.monotonic()
            previous = self.slots.previous
            target = previous if previous is not None and previous.source.sha256 == row["sha256"] else None
            if target is None:
                target = self.loader.load_path(Path(row["path"]), row["info"].get("origin", "deployment"))
            before = worker.last_result_at
            gap_ms = self.slots.rollback_to(target, lambda: self._measure_gap(before))
            record_active(self.store, target, row["info"].get("deployment_id"))
        self.adapt_host.restart()
        result = {"model": target.describe(), "reason": reason, "gap_ms": gap_ms,
                  "took_ms": round((time.monotonic() - started) * 1e3, 1), **({"numbers": numbers} if numbers else {})}
        self.emit("rollback", **result)
        log.warning("rolled back to %s (%s)", target.source.label, reason)
        return result

    def collect_engines(self, pinned: set[str], budget_bytes: int | None = None) -> GcReport:
        """Engine cache GC after a deployment, to `[engines] cache_budget_mb`, never the `pinned` models' engines nor
        those the other lanes serve."""
        return collect_engine_cache(self.config, pinned | self.also_pinned(), budget_bytes, self.on_engine_progress)


def collect_engine_cache(config: AgentConfig, pinned: set[str], budget_bytes: int | None,
                         on_progress: Progress) -> GcReport:
    """Engine cache GC, never the `pinned` models' engines: after a deployment to `[engines] cache_budget_mb`
    (`budget_bytes` None), on a full disk to 0."""
    budget = config.engines.cache_budget_mb * 2**20 if budget_bytes is None else budget_bytes
    return collect_engines(config.cache_dir, state_db_path(config.state_dir), pinned, budget, on_progress)


def stage_watch(loaded: LoadedModel) -> StageWatch | None:
    """The watch of a pipeline's secondary stages, each held to its own member manifest's
    `gates.latency_budget_ms`; None for a single model (its watch is unchanged)."""
    pipeline = loaded.source.manifest.pipeline
    if pipeline is None or not isinstance(loaded.runtime, PipelineRuntime):
        return None
    manifest = loaded.source.manifest
    return StageWatch(loaded.runtime, {s.name: manifest.member(s.name).gates.latency_budget_ms
                                       for s in pipeline.stages})


def record_active(store: StateStore, loaded: LoadedModel, deployment_id: str | None = None) -> None:
    """`loaded` as the active model's row, with where it came from and its gates' verdict in brief."""
    m = loaded.source.manifest
    info = {**loaded.describe(), "origin": loaded.origin, "deployment_id": deployment_id,
            "validation": validation_brief(loaded.provisioned.validation)}
    store.set_active_model(m.name, m.version, str(loaded.source.root), loaded.source.sha256, info)
