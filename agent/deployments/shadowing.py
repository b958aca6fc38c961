"""The deployment manager's `shadowing` step (agent.shadow): start the candidate beside the serving model, keep
its evidence on the deployment row while it runs, and end it on a verdict — its own (promote_when, a cancel
floor, a failing candidate), an operator's (`promote`, `cancel`), or the agent stopping.

Evidence is written to the row at every report, so a crash leaves numbers behind; `recover` ends such a row as
`cancelled(SHADOW_INTERRUPTED)` with them, and says so in a shadow/finished event.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from agent.deployments.store import Deployment, DeploymentStore
from agent.shadow.pipeline_agreement import shadow_metric
from agent.shadow.plan import ShadowArgs, ShadowPlan, resolve
from agent.shadow.session import ShadowSession
from agent.shadow.verdict import Verdict
from agent.base.testhooks import pause_point
from kernel.errors import EdgeError
from engines.model.source import ModelSource

if TYPE_CHECKING:
    from engines.build import ProvisionResult  # the build wing's result, typed only: nothing here builds

log = logging.getLogger(__name__)

Step = Callable[..., None]
POLL_S = 0.25


class ShadowHost(Protocol):
    """What the shadow step needs from the running agent (agent.daemon.swaps.Swaps)."""

    def start_shadow(self, source: ModelSource, provisioned: ProvisionResult, dep: Deployment, plan: ShadowPlan,
                     on_verdict: Callable[[Verdict], None]) -> ShadowSession:
        """Start the candidate beside the serving model; frames flow to it from then on."""
        ...

    def check_shadow(self, source: ModelSource) -> None:
        """Raise (with a code) when `source` cannot shadow the serving model at all."""
        ...

    def stop_shadow(self, session: ShadowSession) -> None:
        """No more frames to it; its thread ends and the candidate's engine is closed."""
        ...

    def serving_label(self) -> str:
        """name@version of the model serving now."""
        ...


class NoShadowError(EdgeError):
    """promote or cancel with no shadow running (or another one than named)."""

    code = "NO_SHADOW"


class ShadowStage:
    """At most one shadow at a time (the manager runs one deployment at a time)."""

    def __init__(self, store: DeploymentStore, host: ShadowHost, emit: Callable[..., None],
                 stop_event: threading.Event) -> None:
        self.store, self.host, self.emit, self.stop_event = store, host, emit, stop_event
        self.session: ShadowSession | None = None
        self._wake = threading.Event()
        self._lock = threading.Lock()

    def run(self, dep: Deployment, source: ModelSource, provisioned: ProvisionResult, args: ShadowArgs,
            step: Step) -> dict[str, Any]:
        """Shadow until a verdict; returns the evidence (the last report plus outcome, reason, message)."""
        plan = resolve(args, source.manifest.shadow)
        serving = self.host.serving_label()
        started = {"model": source.label, "active_model": serving,
                   "metric": shadow_metric(source.manifest), **plan.to_dict()}
        step(dep, "shadowing", details={"shadow": {"plan": plan.to_dict(), "active_model": serving}})
        self._wake.clear()
        session = self.host.start_shadow(source, provisioned, dep, plan, lambda _verdict: self._wake.set())
        with self._lock:
            self.session = session
        self.emit("shadow/started", deployment_id=dep.id, **started)
        try:
            verdict = self._wait(dep, session, plan)
        finally:
            with self._lock:
                self.session = None
            self.host.stop_shadow(session)
        evidence = {**session.report(), "state": "finished", **verdict.to_dict()}
        self.emit("shadow/finished", **evidence)
        return evidence

    def _wait(self, dep: Deployment, session: ShadowSession, plan: ShadowPlan) -> Verdict:
        next_record = time.monotonic() + plan.report_interval_s
        while session.verdict is None:
            self._wake.wait(POLL_S)  # short: an agent stopping must not wait a report interval for this thread
            self._wake.clear()
            if self.stop_event.is_set():
                session.finish(Verdict("cancelled", "SHADOW_STOPPED", "the agent stopped during the shadow"))
            elif not session.is_alive() and session.verdict is None:
                session.finish(Verdict("cancelled", "SHADOW_CANDIDATE_FAILED",
                                       "the shadow's thread ended unexpectedly"))
            if session.verdict is not None or time.monotonic() >= next_record:
                next_record = time.monotonic() + plan.report_interval_s
                report = self._record(dep, session)
                if session.verdict is None:  # on this thread, not the shadow's idle-priority one (it holds no lock)
                    self.emit("shadow/report", **report)
        assert session.verdict is not None
        return session.verdict

    def _record(self, dep: Deployment, session: ShadowSession) -> dict[str, Any]:
        """The running evidence on the row (returned, for the report event); a database that refuses it costs
        nothing but that copy."""
        report = session.report()
        try:
            self.store.record_details(dep, shadow={**(dep.details or {}).get("shadow", {}), "report": report})
        except Exception:
            log.exception("shadow %s: could not record its evidence; it goes on", dep.id)
            return report
        if report["frames"]:
            pause_point("shadow_recorded")  # crash tests: killed mid-shadow, with evidence on the row
        return report

    # --- operator decisions (any thread) --------------------------------------------------------------

    def decide(self, outcome: str, deployment_id: str | None) -> dict[str, Any]:
        """`promote` or `cancel` the running shadow; the deployment goes on in the manager's thread."""
        with self._lock:
            session = self.session
        if session is None or session.done:
            raise NoShadowError("no shadow deployment is running (deploy with mode=shadow first)")
        if deployment_id and deployment_id != session.model.deployment_id:
            raise NoShadowError(f"the running shadow is deployment {session.model.deployment_id}, not {deployment_id}")
        report = session.report()
        numbers = f"after {report['frames']} frames, agreement {report['agreement']}"
        verdict = (Verdict("promoted", "PROMOTE_REQUESTED", f"promoted by an operator {numbers}")
                   if outcome == "promote"
                   else Verdict("cancelled", "CANCEL_REQUESTED", f"cancelled by an operator {numbers}"))
        if not session.finish(verdict):
            raise NoShadowError(f"the shadow has just ended ({session.verdict.reason if session.verdict else '?'})")
        self._wake.set()
        return {"accepted": True, "deployment_id": session.model.deployment_id, "outcome": verdict.outcome,
                "frames": report["frames"], "agreement": report["agreement"]}

    def status(self) -> dict[str, Any] | None:
        """The running shadow's report, None when none runs."""
        session = self.session
        return session.report() if session is not None else None


def end_interrupted_shadow(store: DeploymentStore, dep: Deployment, emit: Callable[..., None]) -> None:
    """End a shadow the agent did not live to finish, with the evidence it had recorded."""
    shadow = (dep.details or {}).get("shadow", {})
    report = shadow.get("report") or {}
    message = (f"the agent stopped during the shadow (after {report.get('frames', 0)} frames compared, agreement "
               f"{report.get('agreement')}); the serving model was kept: deploy again with mode=shadow to resume")
    store.transition(dep, "cancelled", reason="SHADOW_INTERRUPTED", message=message)
    emit("shadow/finished", **{**report, "deployment_id": dep.id, "state": "finished", "outcome": "cancelled",
                               "reason": "SHADOW_INTERRUPTED", "message": message})
    emit("deployment", deployment_id=dep.id, state="cancelled", reason="SHADOW_INTERRUPTED")
