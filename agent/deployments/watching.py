"""The deployment manager's watch step: the deployment under its watch (at most one), its rollback on a verdict,
and what is left of its window when a stop cuts it short (issue 47: SIGTERM 1 s after a swap left a model that
would have been rolled back serving for good).

The row says from `activating` on how much of the window is left (agent.deployments.watch.WatchWindow). A watch
that a stop ends records what was left; the next start (`resume`, on the deployment thread once the frame path
runs) watches the model for that, at least `watch_min_s`, when it is the model serving. A watch that cannot judge
(its record unreadable, the watch itself failing) rolls the model back: a model nobody judged does not stay.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

from agent.deployments.config import DeploymentConfig
from agent.deployments.store import Deployment, DeploymentStore
from agent.deployments.watch import WatchWindow
from kernel.errors import EdgeError

log = logging.getLogger(__name__)


class WatchHost(Protocol):
    """What the watch needs from the running agent (agent.daemon.swaps)."""

    def watch(self, dep: Deployment, stop: threading.Event, window_s: float) -> dict[str, Any] | None:
        """Watch the new model for `window_s`; return the violation (numbers) that requires rollback, or None."""
        ...

    def rollback(self, reason: str, numbers: dict[str, Any] | None = None) -> dict[str, Any]:
        """Swap back to the previous model and record it."""
        ...


class WatchStage:
    """The deployment under its watch; `lock` is held by any rollback, the watch's or an operator's, so only one
    of them rolls back."""

    def __init__(self, store: DeploymentStore, host: WatchHost, config: DeploymentConfig, emit: Callable[..., None],
                 stop_event: threading.Event) -> None:
        self.store, self.host, self.config, self.emit, self.stop_event = store, host, config, emit, stop_event
        self.lock = threading.Lock()
        self.current: Deployment | None = None

    def unwatch(self, dep: Deployment) -> None:
        """`dep` is no longer under watch (unless another one is by now)."""
        with self.lock:
            if self.current is dep:
                self.current = None

    def resume(self) -> None:
        """Watch again, for what is left of its window, the deployment whose watch a stop cut short, when its
        model is the one serving; roll it back when its record cannot be read."""
        dep = self.store.latest_active()
        if dep is None:
            return
        try:
            record = WatchWindow.of(dep.details)
        except ValueError as exc:
            self.current = dep
            self._roll_back(dep, {"reason": "WATCH", "message": f"its watch was cut short by a stop and cannot be "
                                  f"resumed, so it is rolled back: {exc}"}, None)
            self.unwatch(dep)
            return
        if record is None or not record.pending:
            return
        active = self.store.state.model_slot("active")
        if active is None or active["sha256"] != dep.sha256:  # the start serves another model: none of it to watch
            log.warning("deployment %s: its watch was cut short, and its model is not the one serving now", dep.id)
            self.store.record_details(dep, **record.ended().details())
            return
        resumed, window = record.resuming(self.config.watch_min_s)
        self.store.record_details(dep, **resumed.details())
        log.warning("deployment %s: its watch was cut short by a stop with %.1f s of %.1f s left: watching %s@%s "
                    "for %.1f s", dep.id, record.remaining_s, record.window_s, dep.model_name, dep.model_version,
                    window)
        self.current = dep
        self.run(dep, resumed)

    def run(self, dep: Deployment, record: WatchWindow | None = None) -> None:
        """Watch `dep`'s model for what is left of its window and roll it back on a violation, or when it cannot
        be judged (the watch itself failed); a stop records what is left for the next start."""
        if self.current is not dep:  # an operator rolled back before the watch began: nothing to watch
            return
        record = record or _window_of(dep) or WatchWindow.opening(self.config.watch_window_s)
        started = time.monotonic()
        try:
            try:
                violation = self.host.watch(dep, self.stop_event, record.remaining_s)
            except Exception as exc:  # a model nobody could judge does not stay
                log.exception("the watch of deployment %s failed", dep.id)
                violation = {"reason": "WATCH", "message": f"the watch could not judge the model ({exc}), so it is "
                             "rolled back"}
            if violation is None:
                self._ended(dep, record, time.monotonic() - started)
                return
            if record.resumed:
                violation["resumed"] = {"times": record.resumed, "window_s": record.remaining_s}
            self._roll_back(dep, violation, record)
        except EdgeError as exc:
            log.error("watch/rollback of %s failed: %s", dep.id, exc)
        finally:
            self.unwatch(dep)

    def _roll_back(self, dep: Deployment, violation: dict[str, Any], record: WatchWindow | None) -> None:
        """Back to the previous model for `violation`, recorded on `dep`'s row (unless an operator did it meanwhile)."""
        window = record.ended().details() if record is not None else {}
        with self.lock:
            if self.current is not dep:  # an operator rolled back meanwhile
                return
            result = self.host.rollback("watch", violation)
            self.store.transition(dep, "rolled_back", reason=violation.get("reason", "WATCH"),
                                  message=violation.get("message"), details={"watch": violation, **window})
        self.emit("rolled_back", deployment_id=dep.id, **violation, restored=result.get("model"))

    def _ended(self, dep: Deployment, record: WatchWindow, watched_s: float) -> None:
        """Record how the watch ended: judged to its end, or cut short by a stop with so much left."""
        with self.lock:
            if self.current is not dep:  # an operator rolled back meanwhile: the row says so
                return
            after = record.cut_short(watched_s) if self.stop_event.is_set() else record.ended()
        try:
            self.store.record_details(dep, **after.details())
        except Exception:  # the next start then watches it for what the row said before: longer, never shorter
            log.exception("deployment %s: could not record the end of its watch", dep.id)
            return
        if after.pending:
            log.info("deployment %s: the stop cut its watch short with %.1f s left; the next start resumes it",
                     dep.id, after.remaining_s)


def _window_of(dep: Deployment) -> WatchWindow | None:
    """`dep`'s watch record; None when it has none or one that cannot be read (its watch then has the whole window)."""
    try:
        return WatchWindow.of(dep.details)
    except ValueError:
        return None
