"""The agent's side of a deployment (the host agent.deployments.manager drives): provision a candidate, swap it in
between two frames, watch it, commit it or roll back, and run it as a shadow first.

A mixin of agent.daemon.runner.Agent, kept in its own module so the composition root stays readable: every change of
the serving model goes through the model slots (agent.slots) under their lock; adaptation is stopped for the swap and
restarted (held until the watch passes) after it.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from agent.deployments import watch as deployment_watch
from agent.deployments.floors import FpsFloor, capacity_fps, fps_floors, refuse_unmeetable
from agent.deployments.store import Deployment, DeploymentStore
from agent.pipeline.batch_size import batch_curve, stated_fps
from agent.slots import LoadedModel
from engines.errors import EdgeError
from engines.model import ModelSource

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from agent.daemon.adapt_host import AdaptHost
    from agent.daemon.model_loading import ModelLoader
    from agent.daemon.shadow_host import ShadowHost
    from agent.pipeline.batch_size import BatchSize
    from agent.pipeline.cameras import CameraGroup
    from agent.pipeline.output_health import OutputHealth
    from agent.pipeline.worker import InferenceWorker
    from agent.slots import ModelSlots
    from agent.state import StateStore

log = logging.getLogger(__name__)


class Swaps:
    """Deployments, rollbacks and shadows on the running agent (what they use of it is declared here)."""

    config: AgentConfig
    slots: ModelSlots
    loader: ModelLoader | None
    worker: InferenceWorker | None
    cameras: CameraGroup | None
    store: StateStore | None
    shadow_host: ShadowHost | None
    output_health: OutputHealth
    stop_event: threading.Event
    _last_swap: dict[str, Any]
    emit: Callable[..., None]
    swap_model: Callable[[LoadedModel], None]
    _adapt_do: Callable[[Callable[[AdaptHost], Any]], None]
    _batch_size_of: Callable[[ModelSource, Any], BatchSize]
    _record_active: Callable[..., None]

    def fps_floors(self, source: ModelSource, provisioned: Any) -> dict[str, FpsFloor]:
        """Each camera's fps floor under `source`: from its own gate-measured capacity at the batch size it
        will run at and the cameras' stated rates, or an absolute floor (agent.deployments.floors)."""
        size = self._batch_size_of(source, provisioned).size
        capacity = capacity_fps(provisioned.validation, batch_curve(provisioned), size)
        rates = {camera.name: stated_fps(camera) for camera in self.config.camera_list()}
        return fps_floors(self.config.deployments, source.manifest.gates.min_fps, capacity, rates)

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
        self._adapt_do(lambda host: host.stop())  # a deployment replaces the whole family: no variant switch during the swap
        with self.slots.lock:
            fps_before = self.worker.window.fps()
            fps_cameras = {name: round(w.fps(), 2) for name, w in self.worker.camera_windows.items()}
            before = self.worker.last_result_at
            if strategy == "overlap":
                candidate = self.loader.load_provisioned(source, provisioned, "deployment")
                self.swap_model(candidate)
            else:
                candidate = self._stop_start(source, provisioned)
            gap_ms = self._measure_gap(before)
            self.slots.activate(candidate)
        self._adapt_do(lambda host: host.restart(hold=True))  # no variant build or switch until the watch passed (watch)
        self._last_swap = {"strategy": strategy, "gap_ms": gap_ms, "fps_before": round(fps_before, 2),
                           "fps_before_cameras": fps_cameras, "previous_loaded": self.slots.previous is not None}
        return dict(self._last_swap)

    def _stop_start(self, source: ModelSource, provisioned: Any) -> LoadedModel:
        """Free the active engine first (devices that cannot hold two), then load the candidate."""
        assert self.loader is not None and self.worker is not None and self.slots.active is not None
        self.worker.pause()
        try:
            self.slots.active.runtime.close()
            try:
                candidate = self.loader.load_provisioned(source, provisioned, "deployment")
            except Exception:
                restored = self.loader.reload(self.slots.active)  # the old engine must come back
                self.swap_model(restored)
                self.slots.active = restored
                raise
            self.swap_model(candidate)
        finally:
            self.worker.resume()
        self.slots.active.closed = True
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

    def commit_active(self, source: ModelSource, provisioned: Any, dep: Deployment, store: DeploymentStore) -> None:
        """The new active model and the deployment's `active` state, in one transaction."""
        assert self.store is not None and self.slots.active is not None
        with self.store.transaction(durable=True):
            self._record_active(self.slots.active, dep.id)
            store.apply(dep, "active")

    def watch(self, dep: Deployment, stop: threading.Event, window_s: float) -> dict[str, Any] | None:
        """Judge the new model for `window_s` (the watch window, or what a stop left of it); the first violation
        (with numbers) or None."""
        assert self.worker is not None and self.cameras is not None
        assert self.slots.active is not None
        budget = self.slots.active.source.manifest.gates.latency_budget_ms
        floors = self.fps_floors(self.slots.active.source, self.slots.active.provisioned)
        violation = deployment_watch.watch_model(
            self.worker, self.cameras, self.config.deployments, budget, stop, floors,
            still_current=lambda: self.slots.active is not None and self.slots.active.deployment_ok(dep),
            health=self.output_health, window_s=window_s)
        if violation is not None:
            violation["swap_gap_ms"] = self._last_swap.get("gap_ms")
            return violation
        if not stop.is_set() and self.slots.active.deployment_ok(dep):
            self.emit("watch_passed", deployment_id=dep.id, swap_gap_ms=self._last_swap.get("gap_ms"),
                      **deployment_watch.watch_summary(self.worker, floors, self.output_health))
        self._adapt_do(lambda host: host.release())  # the new family builds its variants and switches only now
        return None

    def start_shadow(self, source: ModelSource, provisioned: Any, dep: Deployment, plan: Any,
                     on_verdict: Callable[[Any], None]) -> Any:
        """A shadow deployment's candidate beside the serving model (agent.daemon.shadow_host)."""
        assert self.shadow_host is not None
        return self.shadow_host.start(source, provisioned, dep, plan, on_verdict)

    def check_shadow(self, source: ModelSource) -> None:
        """Refuse a shadow that could compare nothing (SHADOW_INCOMPARABLE)."""
        assert self.shadow_host is not None
        self.shadow_host.check_comparable(source)

    def stop_shadow(self, session: Any) -> None:
        """The shadow gets no more frames; its engine is closed."""
        assert self.shadow_host is not None
        self.shadow_host.stop(session)

    def serving_label(self) -> str:
        """name@version of the serving model."""
        return self.slots.serving_label()

    def rollback(self, reason: str, numbers: dict[str, Any] | None = None) -> dict[str, Any]:
        """Back to the previous model: instant when it is still loaded, else loaded again from its artifact."""
        assert self.store is not None and self.loader is not None and self.worker is not None
        self._adapt_do(lambda host: host.stop())  # back to the previous family, at the variant kept loaded for it
        with self.slots.lock:
            row = self.store.model_slot("previous")
            if row is None:
                raise EdgeError("no previous model to roll back to", code="NO_PREVIOUS_MODEL")
            started = time.monotonic()
            target = self.slots.previous if self.slots.previous is not None and self.slots.previous.source.sha256 == row["sha256"] else None
            if target is None:
                target = self.loader.load_path(Path(row["path"]), row["info"].get("origin", "deployment"))
            before = self.worker.last_result_at
            gap_ms = self.slots.rollback_to(target, lambda: self._measure_gap(before))
            self._record_active(target, row["info"].get("deployment_id"))
        self._adapt_do(lambda host: host.restart())
        result = {"model": target.describe(), "reason": reason, "gap_ms": gap_ms,
                  "took_ms": round((time.monotonic() - started) * 1e3, 1), **({"numbers": numbers} if numbers else {})}
        self.emit("rollback", **result)
        log.warning("rolled back to %s (%s)", target.source.label, reason)
        return result
