"""One shadow deployment running: the candidate in its own low-priority process (agent.shadow.candidate_process;
or on this session's thread), fed a share of the frames the serving model just finished, compared with the
serving model's results on the same frames.

The frame path only offers: a counter decides whether this frame is in the share, the pressure check (cached)
whether the shadow must yield, and the frame and a frozen copy of its result go into a one-slot mailbox. A frame
that finds the slot taken replaces it (the candidate is behind: the older one is skipped as `busy`). Nothing
on the frame path waits on the candidate, its engine, the disk or the network.

The session's thread, and the candidate's process, lower their scheduling priority before the candidate loads
(Linux: SCHED_IDLE, else a higher nice value), so the engine's threads, created by the load, inherit it: on a
saturated CPU the shadow gets what the frame path leaves, and its skipped frames say so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np

from agent.pipeline.histogram import LatencyHistogram
from agent.shadow.agreement import ShadowAgreement
from agent.shadow.candidate_process import CandidateHalted, CandidateProcess
from agent.shadow.pipeline_agreement import PipelineComparison
from agent.shadow.plan import ShadowPlan
from agent.shadow.priority import SHADOW_NICE, lower_priority
from agent.shadow.pressure import ServingPressure, TimeShare
from agent.shadow.verdict import Verdict, judge
from engines.evaluation.live_agreement import frozen_copy, live_metric
from engines.postprocess import InferenceResult
from engines.runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)

class Candidate(Protocol):
    """What the session runs frames through: a ModelRuntime, or the candidate's own process
    (agent.shadow.candidate_process.CandidateProcess) that answers the same two calls."""

    def run(self, image: np.ndarray, stream: str) -> tuple[InferenceResult, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ShadowModel:
    """What the session runs: `load(halt)` returns the loaded Candidate; called on the shadow's own thread, it
    gives up (CandidateHalted) when `halt` is set while it waits."""

    deployment_id: str
    label: str  # name@version
    kind: str
    labels: tuple[str, ...] | None
    budget_ms: float | None
    load: Callable[[threading.Event], Candidate]
    # two pipelines: compared end to end (agent.shadow.pipeline_agreement); `kind` is then the primary's (health)
    pipeline: PipelineComparison | None = None

    def metric(self) -> str:
        """The name of what the agreement measures (the report's `metric`)."""
        return f"end_to_end_{self.pipeline.metric}" if self.pipeline is not None else live_metric(self.kind)


@dataclass
class _Offer:
    camera: str
    image: np.ndarray
    result: InferenceResult
    serving: int = 0  # how many serving-model swaps the session had seen when this frame was offered


@dataclass
class _Counts:
    offered: int = 0
    skipped: Counter = field(default_factory=Counter)
    serving_swaps: int = 0


class ShadowSession(threading.Thread):
    """Started by the deployment manager; ends with a Verdict (its own, or `finish` from outside)."""

    def __init__(self, model: ShadowModel, serving_label: str, plan: ShadowPlan, pressure: ServingPressure,
                 on_verdict: Callable[[Verdict], None]) -> None:
        super().__init__(name="shadow", daemon=True)
        self.model, self.plan, self.pressure = model, plan, pressure
        self.serving_label = serving_label
        self.agreement = ShadowAgreement(model.kind, model.labels, plan.window_frames, model.pipeline)
        self.time_share = TimeShare(plan.share)
        self.candidate_ms = LatencyHistogram()
        self.verdict: Verdict | None = None
        self._on_verdict = on_verdict
        self._counts = _Counts()
        self._credit: dict[
            str, float
        ] = {}  # per camera: a batch delivers cameras in one order, one counter would alias
        self._serving: ModelRuntime | None = None
        self._windows_serving = 0  # the swap count the agreement windows were last restarted for (shadow thread)
        self._slot: Optional[_Offer] = None
        self._cond = threading.Condition()
        self._ready = threading.Event()
        self._halt = threading.Event()
        self._began = time.monotonic()
        self.priority = "normal"  # how the candidate was put below the frame path (lower_priority)
        self.isolation = "process"  # where the candidate runs: its own process, or this thread

    # --- the frame path (results thread) --------------------------------------------------------------

    def offer(self, camera: str, image: np.ndarray, captured_at: float, result: InferenceResult,
              runtime: ModelRuntime) -> None:
        """One frame the serving model finished; never blocks."""
        now = time.monotonic()
        self.pressure.record((now - captured_at) * 1e3, now)
        if runtime is not self._serving:
            if self._serving is not None:  # a variant switch or another swap: compare afresh from here (the
                self._counts.serving_swaps += 1  # shadow thread restarts the windows at the first such frame)
            self._serving = runtime
        credit = self._credit.get(camera, 1.0 - self.plan.share) + self.plan.share  # each camera's first frame counts
        if credit < 1.0 - 1e-9:
            self._credit[camera] = credit
            return
        self._credit[camera] = credit - 1.0
        self._counts.offered += 1
        reason = "loading" if not self._ready.is_set() else self.pressure.reason(now)
        if reason is None and not self.time_share.allows(now):
            reason = "cost"
        if reason is not None or self._halt.is_set():
            self._counts.skipped[reason or "stopping"] += 1
            return
        # never wait for the lock: the shadow thread holds it for an instant, but at SCHED_IDLE on a saturated CPU
        # that instant can be a long wait (a priority inversion on the frame path); this frame is skipped instead
        if not self._cond.acquire(blocking=False):
            self._counts.skipped["busy"] += 1
            return
        try:
            if self._slot is not None:
                self._counts.skipped["busy"] += 1
            self._slot = _Offer(camera, image, frozen_copy(result), self._counts.serving_swaps)
            self._cond.notify()
        finally:
            self._cond.release()

    # --- control ------------------------------------------------------------------------------------------

    def finish(self, verdict: Verdict) -> bool:
        """End the shadow with `verdict` (an operator's promote or cancel); False when it had ended already."""
        with self._cond:
            if self.verdict is not None:
                return False
            self.verdict = verdict
            self._halt.set()
            self._cond.notify_all()
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (the candidate's engine is closed on it)."""
        self._halt.set()
        with self._cond:
            self._cond.notify_all()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
            if self.is_alive():
                log.warning("shadow %s: its thread did not end within %.0f s (a candidate still loading?)",
                            self.model.deployment_id, timeout)

    @property
    def done(self) -> bool:
        """True once a verdict is in."""
        return self.verdict is not None

    # --- the shadow thread ----------------------------------------------------------------------------

    def run(self) -> None:
        self.priority = lower_priority(SHADOW_NICE)
        try:
            candidate = self.model.load(self._halt)
        except CandidateHalted:
            return
        except Exception as exc:
            log.exception("shadow %s: the candidate could not be loaded", self.model.deployment_id)
            self._conclude(Verdict("cancelled", "SHADOW_CANDIDATE_FAILED", f"the candidate could not be loaded: {exc}"))
            return
        if isinstance(candidate, CandidateProcess):  # its process's priority, when it has one
            self.priority = candidate.priority
        self.isolation = "process" if isinstance(candidate, CandidateProcess) else "thread"
        self._ready.set()
        try:
            self._loop(candidate)
        finally:
            try:
                candidate.close()
            except Exception:
                log.exception("shadow %s: closing the candidate failed", self.model.deployment_id)

    def _loop(self, runtime: Candidate) -> None:
        while not self._halt.is_set():
            with self._cond:
                if self._slot is None:
                    self._cond.wait(0.2)
                offer, self._slot = self._slot, None
            if offer is not None and not self._halt.is_set():
                verdict = self._compare(runtime, offer)
                if verdict is not None:
                    self._conclude(verdict)
                    return

    def _compare(self, runtime: Candidate, offer: _Offer) -> Verdict | None:
        started = time.perf_counter()
        try:
            result, times = runtime.run(offer.image, offer.camera)  # a stateful candidate: each camera its own
        except CandidateHalted:
            return None  # stopped from outside while the frame was out: the verdict (if any) is the caller's
        except Exception as exc:  # noqa: BLE001 - the candidate fails on a live frame: the shadow ends, serving goes on
            log.warning(
                "shadow %s: the candidate failed on a frame of %s: %s", self.model.deployment_id, offer.camera, exc
            )
            return Verdict(
                "cancelled",
                "SHADOW_CANDIDATE_FAILED",
                f"the candidate failed on a frame of camera {offer.camera}: {type(exc).__name__}: {exc}"[:500],
            )
        self.time_share.spend(time.perf_counter() - started)
        # a pipeline's latency is end to end: its secondary stages run in its postprocessing (PipelineRuntime.run)
        if self.model.pipeline is None:
            self.candidate_ms.record(times.infer)
        else:
            self.candidate_ms.record(times.preprocess + times.infer + times.postprocess)
        if offer.serving != self._windows_serving:  # the first frame the new serving model delivered: windows afresh
            self.agreement.restart_windows()  # here, not on the results thread: its lock is shared with this one
            self._windows_serving = offer.serving
        self.agreement.add(offer.camera, offer.result, result, offer.image)
        return judge(self.plan, self.model.kind, self.agreement.numbers(), self.candidate_ms.percentile(99),
                     self.model.budget_ms)

    def _conclude(self, verdict: Verdict) -> None:
        if self.finish(verdict):
            log.info("shadow %s: %s (%s): %s", self.model.deployment_id, verdict.outcome, verdict.reason,
                     verdict.message)
            self._on_verdict(verdict)

    # --- numbers ---------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The shadow's numbers: status, telemetry, shadow/report and shadow/finished, the deployment's evidence."""
        counts = self._counts
        numbers = self.agreement.numbers()
        latency = _latency(self.candidate_ms)
        p99 = self.pressure.p99()
        return {"deployment_id": self.model.deployment_id, "model": self.model.label,
                "active_model": self.serving_label, "metric": self.model.metric(), **numbers,
                **({"pipeline": self.model.pipeline.to_dict()} if self.model.pipeline is not None else {}),
                "share": round(self.plan.share, 6), "offered": counts.offered, "skipped": dict(counts.skipped),
                "skipped_total": sum(counts.skipped.values()),
                "candidate_ms": latency, "active_p99_ms": None if p99 is None else round(p99, 3),
                "serving_swaps": counts.serving_swaps, "priority": self.priority, "isolation": self.isolation,
                "elapsed_s": round(time.monotonic() - self._began, 1),
                "state": "loading" if not self._ready.is_set() else ("finished" if self.done else "running")}

    def telemetry(self) -> dict[str, Any]:
        """The compact form every telemetry sample carries while the shadow runs."""
        full = self.report()
        latency = full["candidate_ms"] or {}
        return {"deployment_id": full["deployment_id"], "model": full["model"], "frames": full["frames"],
                "agreement": full["agreement"], "window_agreement": full["window_agreement"],
                "candidate_p99_ms": latency.get("p99"), "skipped_total": full["skipped_total"]}


def _latency(histogram: LatencyHistogram) -> dict[str, float] | None:
    if not histogram.count:
        return None
    return {"mean": round(histogram.mean or 0.0, 3), "p50": round(histogram.percentile(50) or 0.0, 3),
            "p99": round(histogram.percentile(99) or 0.0, 3), "count": histogram.count}
